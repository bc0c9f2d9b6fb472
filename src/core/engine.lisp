;;;; engine.lisp -- the engine: what one server holds, and its settings.
;;;;
;;;; An engine owns a worker pool (whose epoll sets hold every connection
;;;; that waits for input), a table from fd to connection, and a
;;;; housekeeper thread that accepts new connections, sheds load with 503 when the queue of
;;;; not-yet-served connections is full, drains rejected connections before
;;;; closing them (so a client reads its error response instead of a reset),
;;;; and closes connections whose deadline passed.
;;;;
;;;; Invariants:
;;;;  - TABLE[fd] is the live CONNECTION on fd, or NIL.  It is set before the
;;;;    fd is registered anywhere and cleared before the fd is closed, because
;;;;    the kernel reuses fd numbers at once.
;;;;  - A connection's epoll data is its TOKEN, (generation << 32) | fd, so an
;;;;    event that was already dequeued for a connection since closed is
;;;;    recognised as stale and dropped.
;;;;  - PENDING counts accepted connections no worker has served yet: the
;;;;    queue that MAX-QUEUE bounds.  IN-FLIGHT counts requests inside the
;;;;    request handler.
;;;;  - REQUESTS and IN-FLIGHT, and the metrics' counts (TALLY-COUNTS), are
;;;;    kept in stripes (TALLY), one per group of workers, and summed on
;;;;    read: a connection counts its requests in the stripe of its group
;;;;    (CONNECTION-TALLY, chosen when it is made), so a request begins and
;;;;    ends in the same stripe, and workers on different CPUs write no
;;;;    common cache line per request.

(in-package #:gallop.core)

(defconstant +listen-data+ (- (expt 2 64) 2)
  "epoll data of the listen socket in the housekeeper's epoll set.")
(defconstant +stop-data+ (- (expt 2 64) 3)
  "epoll data of the stop eventfd in the housekeeper's epoll set.")
(defconstant +timer-data+ (- (expt 2 64) 5)
  "epoll data of the application timers' timerfd in the housekeeper's epoll set.")
(defconstant +keeper-wake-data+ (- (expt 2 64) 6)
  "epoll data of the eventfd that ends the housekeeper's rest (WHEEL-WAKE-FD)
in its epoll set.")

;;; Default limits (the README compares them with other servers').
(defconstant +default-max-head-bytes+ (* 1024 1024)
  "Request heads over this get 431.  Go's net/http default; a request with a
96,000-octet header (Clack's handler tests send one) is served.")
(defconstant +default-max-request-line-bytes+ (* 64 1024)
  "Request lines over this get 414.")
(defconstant +default-max-unsent-bytes+ (* 64 1024)
  "Octets a streaming writer may leave unsent on one connection before what
it writes on is charged to the memory account (output-queue.lisp).")
(defconstant +kernel-unsent-bytes+ (* 16 1024)
  "Octets of a connection's output the kernel may hold not yet sent
(TCP_NOTSENT_LOWAT, set on the listen socket and inherited).  Without it
Linux grows a socket's send buffer up to tcp_wmem's maximum (4 MiB by
default), so a client that never reads would have the server answer
thousands of pipelined requests before a send found the socket full and the
backpressure in output-queue.lisp began.  16 KiB is what Apple's and
Cloudflare's servers use; only data not yet sent is limited, not what is in
flight, so a fast client's downloads keep their speed.")
(defconstant +default-max-body-bytes+ (* 64 1024 1024)
  "Bodies over this get 413.  Bodies are streamed, so this bounds a
client's upload, not the server's memory.")

;;; What a stripe counts for the metrics (metrics.lisp), besides its request
;;; counters: per answer, its method and status class and which duration
;;; bucket it fell in, and the octets received and sent.  They are the cells
;;; of one word vector per stripe (TALLY-COUNTS), each bumped with one atomic
;;; add, no lock and no allocation; a scrape sums the stripes.  The vector
;;; has +COUNTS-PAD+ unused words either side of its cells, so that its
;;; cells share no cache line with another stripe's or with any other object.

(sb-int:defconstant-eqx +counted-methods+
    #("GET" "HEAD" "POST" "PUT" "DELETE" "PATCH" "OPTIONS" "other")
  #'equalp
  "The methods answers are counted by, as METHOD-INDEX numbers them; every
other method counts as the last.")

(defconstant +status-classes+ 5
  "Status classes answers are counted by: 1xx to 5xx.")

(sb-int:defconstant-eqx +duration-bounds-us+
    #(1000 2500 5000 10000 25000 50000 100000 250000 500000
      1000000 2500000 5000000 10000000)
  #'equalp
  "The upper bounds of the request-duration buckets, in microseconds: a
bucket holds the durations up to its bound, and one more bucket the longer
ones.")

(sb-int:defconstant-eqx +duration-bound-labels+
    #("0.001" "0.0025" "0.005" "0.01" "0.025" "0.05" "0.1" "0.25" "0.5" "1" "2.5" "5" "10")
  #'equalp
  "The bounds of +DURATION-BOUNDS-US+ as the le labels of the histogram, in seconds.")

(defconstant +counts-pad+ 8
  "Unused words before and after the cells of a stripe's counts.")

;;; The cells, as indexes into a stripe's counts.
(defconstant +answer-cells+ +counts-pad+
  "The first of the answer counts, (+ +ANSWER-CELLS+ (* +STATUS-CLASSES+
METHOD-INDEX) CLASS-INDEX).")
(defconstant +bucket-cells+ (+ +answer-cells+ (* (length +counted-methods+) +status-classes+))
  "The first of the duration buckets' counts (not cumulative).")
(defconstant +duration-us-cell+ (+ +bucket-cells+ (length +duration-bounds-us+) 1)
  "Microseconds of all the durations counted.")
(defconstant +bytes-in-cell+ (+ +duration-us-cell+ 1)
  "Octets read from clients' connections (see CONNECTION-RECV).")
(defconstant +bytes-out-cell+ (+ +bytes-in-cell+ 1)
  "Octets clients' connections took (see CONNECTION-SEND).")
(defconstant +tls-handshakes-cell+ (+ +bytes-out-cell+ 1)
  "TLS handshakes completed.")
(defconstant +counts-end+ (+ +tls-handshakes-cell+ 1)
  "The index after the last cell.")

(deftype counts () `(simple-array sb-ext:word (,(+ +counts-end+ +counts-pad+))))

(defun make-counts ()
  (make-array (+ +counts-end+ +counts-pad+) :element-type 'sb-ext:word :initial-element 0))

(defstruct (tally (:constructor make-tally ()) (:copier nil))
  "One stripe of an engine's request counters: those of the connections of
one group of workers (see the header), and its COUNTS (above).  Changed
atomically (another thread may end a request: a suspended one's answerer, a
worker of another group that stole the event).  Seven words either side, so
that stripes written on different CPUs share no 64-octet cache line with
each other or with the engine's settings, which every request reads."
  (pad-before-1 0) (pad-before-2 0) (pad-before-3 0) (pad-before-4 0)
  (pad-before-5 0) (pad-before-6 0) (pad-before-7 0)
  (requests 0 :type sb-ext:word)
  (in-flight 0 :type sb-ext:word)
  (counts (make-counts) :type counts :read-only t)
  (pad-after-1 0) (pad-after-2 0) (pad-after-3 0) (pad-after-4 0)
  (pad-after-5 0) (pad-after-6 0) (pad-after-7 0))

(defmethod print-object ((tally tally) stream)
  (print-unreadable-object (tally stream :type t :identity t)))

(defun make-tallies ()
  "An engine's stripes: one per group its pool will have (one per CPU this
process may use, or *GROUP-COUNT*), at most 64, made once, so that the
counts outlive a restart of the pool; groups beyond share them in turn."
  (let ((tallies (make-array (max 1 (min 64 (or *group-count* (ceiling (usable-cpus))))))))
    (dotimes (i (length tallies) tallies)
      (setf (svref tallies i) (make-tally)))))

(defstruct (engine (:constructor %make-engine) (:copier nil))
  (name "gallop" :type string)
  (pool nil)
  (handler nil :type (or null function))
  (raw-p nil)
  (tls nil) ; a TLS-CONTEXT (openssl.lisp): every connection is TLS
  (table #() :type simple-vector)
  (generation 0 :type sb-ext:word)
  (listen-fd -1 :type fixnum)
  (housekeeper-epfd -1 :type fixnum)
  (stop-fd -1 :type fixnum)
  (housekeeper nil)
  (wheel nil)
  (state :stopped :type (member :stopped :running :stopping))
  ;; Set before a soft stop (ENGINE-DRAIN) so that a readiness check fails
  ;; while the server still serves, and a load balancer stops sending first.
  (draining nil)
  ;; True when the listen socket is the engine's to end (ENGINE-START's
  ;; OWN-LISTENER: not one a supervisor passed and keeps); then a soft stop
  ;; sets FINAL-ACCEPT, and the housekeeper's last act is FINAL-ACCEPT.
  (own-listener nil)
  (final-accept nil)
  ;; Set by the housekeeper once it stopped accepting, at a stop's start; it
  ;; then serves on (timers, deadlines, lingering closes) until ENGINE-STOP
  ;; sets HOUSEKEEPER-EXIT.
  (accepting-ended nil)
  (housekeeper-exit nil)
  ;; settings, in milliseconds and octets: MAKE-ENGINE sets them from the
  ;; user's settings and their defaults, which are in one place (settings.lisp)
  (header-timeout-ms 0 :type fixnum)
  (idle-timeout-ms 0 :type fixnum)
  (read-timeout-ms 0 :type fixnum)
  (write-timeout-ms 0 :type fixnum)
  (handler-timeout-ms 0 :type fixnum) ; 0: handlers run as long as they like
  (stop-timeout-ms 0 :type fixnum)
  (stop-idle-grace-ms 0 :type fixnum)
  (linger-ms 2000 :type fixnum)
  (max-head-bytes 0 :type fixnum)
  (max-body-bytes 0 :type fixnum)
  (max-request-line-bytes 0 :type fixnum)
  (max-unsent-bytes 0 :type fixnum)
  (max-waiting-writers 1 :type fixnum) ; see WAIT-FOR-ROOM (output-queue.lisp)
  (upgraded-idle-ms 0 :type fixnum)  ; 0: an upgraded connection may stay silent
  (upgraded-send-limit 0 :type fixnum)
  (max-switched 0 :type fixnum)      ; MOST-POSITIVE-FIXNUM: as memory allows
  (methods nil :type list) ; NIL: every method; else those served, the others get 501
  (max-queue 0 :type fixnum)
  (head-budget 0 :type fixnum) ; see connection.lisp (the head budget)
  ;; request bodies the engine gathers before the handler (spool.lisp)
  (body-buffer-bytes 0 :type fixnum) ; per request, in memory
  (body-budget 0 :type fixnum)       ; all requests, in memory
  (disk-budget 0 :type fixnum)       ; all requests, in temporary files
  (temp-directory "/tmp/" :type simple-string)
  (streamed-bodies nil :type (or null function))
  (min-rate 0 :type fixnum)           ; octets a second; 0: no minimum
  (rate-grace-ms 0 :type fixnum)
  (retry-after 1 :type fixnum)
  (response-503 nil) ; the 503 answer with this engine's Retry-After, encoded once
  ;; counters
  (accepted 0 :type sb-ext:word)
  (closed 0 :type sb-ext:word)
  (tallies (make-tallies) :type simple-vector) ; REQUESTS and IN-FLIGHT, see TALLY
  (shed 0 :type sb-ext:word)
  (timeouts 0 :type sb-ext:word)
  (write-timeouts 0 :type sb-ext:word)
  (aborted 0 :type sb-ext:word)
  (rejected 0 :type sb-ext:word)
  (pending 0 :type sb-ext:word)
  (claims 0 :type sb-ext:word) ; fresh connections handed to free workers this tick (FREE-WORKERS)
  (head-bytes 0 :type sb-ext:word)
  (body-bytes 0 :type sb-ext:word)   ; octets of gathered bodies in memory (spool.lisp)
  (disk-bytes 0 :type sb-ext:word)   ; and in temporary files
  (body-files 0 :type sb-ext:word)   ; bodies that went to a temporary file, in all
  (slow-clients 0 :type sb-ext:word) ; closed for sending or reading under the minimum rate
  (waiting-writers 0 :type sb-ext:word) ; writers waiting for their clients now (WAIT-FOR-ROOM)
  (writers-shed 0 :type sb-ext:word)    ; connections closed instead, in all
  (tls-freed 0 :type sb-ext:word)    ; SSL objects freed, in all (see TRIM-MALLOC)
  (tls-trimmed 0 :type sb-ext:word)  ; TLS-FREED at the last trim
  (trim-ms 0 :type fixnum)           ; when that was
  (suspended 0 :type sb-ext:word) ; requests answered later from another thread, not yet done
  (abandoned 0 :type sb-ext:word) ; such requests whose client went away first
  (upgraded 0 :type sb-ext:word)  ; connections that switched protocols, open now
  (upgrades 0 :type sb-ext:word)  ; and in all
  (switched 0 :type sb-ext:word)  ; switched under a handler that keeps its thread, open now
  (stop-cut 0 :type sb-ext:word)  ; requests whose handler a stop cut (ENGINE-STOP)
  (lock (sb-thread:make-mutex :name "gallop engine"))
  (idle-queue (sb-thread:make-waitqueue :name "gallop in-flight"))
  (log-error nil :type (or null function))
  ;; The layer above's access log of the answers the engine writes itself
  ;; (NOTE-REFUSAL, http1.lisp), or NIL.
  (log-answer nil :type (or null function))
  (last-emfile-ms 0 :type fixnum)
  (timeout-line-ms 0 :type fixnum) ; see TIMEOUT-LINE-DUE
  (disk-error-ms 0 :type fixnum) ; see SPOOL-FAILED
  (timeout-lines-skipped 0 :type sb-ext:word)
  (backtrace-second 0 :type fixnum) ; see BACKTRACE-DUE-P
  (backtraces 0 :type sb-ext:word))

;;; Every structure of the engine prints as one short unreadable line: they
;;; appear as arguments in the backtraces of handler errors, and printed in
;;; full an engine is its whole connection table.
(defmethod print-object ((engine engine) stream)
  (print-unreadable-object (engine stream :type t :identity t)
    (format stream "~A" (engine-name engine))))

(defun note-client-abort (engine)
  "Count a request the client gave up on.  Not logged: clients close and
reset connections all the time, and it is not the server's fault."
  (sb-ext:atomic-incf (engine-aborted engine)))

(defconstant +timeout-line-ms+ 60000
  "The least time between two log lines about timeouts of clients.")

(defun timeout-line-due (engine)
  "A client timed out (it stopped reading its answer, or sending its body):
is a log line due?  NIL when one was written less than +TIMEOUT-LINE-MS+
ago (this one is counted instead), else the number of such lines left
unwritten since the last.  A client can time out on purpose, by the
thousand: one line a minute says so, not one line a client."
  (let ((now (now-ms))
        (last (engine-timeout-line-ms engine)))
    (if (and (or (zerop last) (>= (- now last) +timeout-line-ms+))
             (eql last (sb-ext:compare-and-swap (engine-timeout-line-ms engine) last now)))
        (loop (let ((n (engine-timeout-lines-skipped engine)))
                (when (eql n (sb-ext:compare-and-swap (engine-timeout-lines-skipped engine) n 0))
                  (return n))))
        (progn (sb-ext:atomic-incf (engine-timeout-lines-skipped engine))
               nil))))

(defconstant +backtraces-per-second+ 10
  "The most backtraces of handler errors an engine makes in a second.")

(defun backtrace-due-p (engine)
  "A handler failed: may its backtrace be taken?  True for the first
+BACKTRACES-PER-SECOND+ errors of each second.  A backtrace costs several
times what the error's answer does, and clients choose how many errors
there are: past the first few a second, the error is still logged, with its
message (doc/design.md, \"A handler's error costs a bounded backtrace\")."
  (let ((second (floor (now-ms) 1000)))
    (unless (= second (engine-backtrace-second engine))
      (setf (engine-backtrace-second engine) second
            (engine-backtraces engine) 0))
    ;; ATOMIC-INCF returns the count before this error.
    (< (sb-ext:atomic-incf (engine-backtraces engine)) +backtraces-per-second+)))

(defun rate-deadline (engine start octets)
  "When a transfer that began at START (NOW-MS) and has moved OCTETS so far
falls under ENGINE's minimum data rate, if no more octets move: after the
grace, the time at which OCTETS is the minimum rate's worth.  NIL when the
engine has no minimum."
  (declare (type fixnum start octets))
  (let ((rate (engine-min-rate engine)))
    (and (plusp rate)
         (+ start (max (engine-rate-grace-ms engine) (floor (* 1000 octets) rate))))))

(declaim (inline engine-running-p))
(defun engine-running-p (engine)
  (eq (engine-state engine) :running))

(defun engine-tally (engine group-index)
  "The stripe of ENGINE's counters for the connections of the pool's group
GROUP-INDEX (NIL: a connection in no group)."
  (let ((tallies (engine-tallies engine)))
    (svref tallies (mod (or group-index 0) (length tallies)))))

(defun engine-requests (engine)
  "Requests ENGINE's handler began, in all: its stripes summed."
  (loop for tally across (engine-tallies engine) sum (tally-requests tally)))

(defun engine-in-flight (engine)
  "Requests inside ENGINE's handler now: its stripes summed (each stripe's
count is its own requests begun minus ended, never below zero).  Read while
requests begin and end in other stripes, the sum is as if those had come in
another order; a soft stop, which waits for zero, has the same race with a
request that begins just after it looked."
  (loop for tally across (engine-tallies engine) sum (tally-in-flight tally)))

;;; Counting an answer (see TALLY-COUNTS): a few typed steps and three
;;; atomic adds on the stripe of the connection, no generic call.

(declaim (inline method-index status-class duration-bucket))
(defun method-index (method)
  "The index of METHOD (a request's method keyword, or NIL) in +COUNTED-METHODS+."
  (case method
    (:get 0) (:head 1) (:post 2) (:put 3) (:delete 4) (:patch 5) (:options 6)
    (t 7)))

(defun status-class (status)
  "The class index of the status code STATUS: 0 for 1xx to 4 for 5xx.  A
status out of that range counts as 5xx, as the native layer answers it 500."
  (if (and (typep status 'fixnum) (<= 100 status 599))
      (1- (floor status 100))
      4))

(defun duration-bucket (us)
  "The index of the bucket of a duration of US microseconds (see
+DURATION-BOUNDS-US+)."
  (declare (type fixnum us) (optimize speed))
  (let ((bounds (load-time-value (coerce +duration-bounds-us+ '(simple-array fixnum (*))) t)))
    (declare (type (simple-array fixnum (*)) bounds))
    (dotimes (i (length bounds) (length bounds))
      (when (<= us (aref bounds i))
        (return i)))))

(declaim (inline count-answer-in))
(defun count-answer-in (tally method status us)
  "Count in TALLY an answer with STATUS to a request of METHOD that took US
microseconds (NIL: no duration, the answer to a request whose head was never
complete, which a client could otherwise stretch to the header timeout or
shrink to nothing, and so skew the histogram)."
  (declare (type (or null fixnum) us))
  (let ((counts (tally-counts tally)))
    (sb-ext:atomic-incf (aref counts (+ +answer-cells+
                                        (* +status-classes+ (method-index method))
                                        (status-class status))))
    (when us
      (let ((us (max 0 us)))
        (sb-ext:atomic-incf (aref counts (+ +bucket-cells+ (duration-bucket us))))
        (sb-ext:atomic-incf (aref counts +duration-us-cell+) us)))
    nil))

(defun engine-counts (engine)
  "ENGINE's counts for the metrics, its stripes summed: a fresh simple vector
indexed as a stripe's TALLY-COUNTS are."
  (let ((sum (make-array +counts-end+ :initial-element 0)))
    (loop for tally across (engine-tallies engine)
          do (let ((counts (tally-counts tally)))
               (loop for i from +answer-cells+ below +counts-end+
                     do (incf (svref sum i) (aref counts i)))))
    sum))

(defconstant +max-log-line+ 8192
  "The most characters of one message Gallop writes to a log: a condition's
report or a backtrace beyond it is cut (CUT-LOG-LINE).  What a client makes
a server log must cost a bounded amount.")

(defun cut-log-line (string)
  "STRING, or its start and a note of how much was cut when it is longer
than +MAX-LOG-LINE+."
  (if (<= (length string) +max-log-line+)
      string
      (let ((note (format nil "~%... (~D more characters not logged)"
                          (- (length string) +max-log-line+))))
        (concatenate 'string (subseq string 0 (- +max-log-line+ (length note))) note))))

(defclass log-line-stream (sb-gray:fundamental-character-output-stream)
  ((out :initform (make-string-output-stream) :reader log-line-out)
   (left :initform +max-log-line+ :accessor log-line-left))
  (:documentation "A string stream that takes +MAX-LOG-LINE+ characters, then
throws to LOG-LINE-FULL: what a log line may cost to make is bounded too."))

(defmethod sb-gray:stream-write-char ((s log-line-stream) char)
  (when (<= (log-line-left s) 0)
    (throw 'log-line-full t))
  (decf (log-line-left s))
  (write-char char (log-line-out s)))

(defmethod sb-gray:stream-write-string ((s log-line-stream) string &optional (start 0) end)
  (let* ((end (or end (length string)))
         (n (min (- end start) (max 0 (log-line-left s)))))
    (write-string string (log-line-out s) :start start :end (+ start n))
    (decf (log-line-left s) n)
    (when (< n (- end start))
      (throw 'log-line-full t))
    string))

(defmethod sb-gray:stream-line-column ((s log-line-stream))
  nil)

(defun format-log-line (format-control args)
  "FORMAT-CONTROL applied to ARGS, as a string of at most +MAX-LOG-LINE+
characters and a note when it was cut (the rest is not even made); true as
a second value when it was cut."
  (let* ((stream (make-instance 'log-line-stream))
         (cut (catch 'log-line-full
                (apply #'format stream format-control args)
                nil))
         (text (get-output-stream-string (log-line-out stream))))
    (if cut
        (values (concatenate 'string text (format nil "~%... (the rest not logged)")) t)
        (values text nil))))

(defun log-engine-error (engine format-control &rest args)
  (let ((log (engine-log-error engine)))
    (if log
        (ignore-errors (apply log format-control args))
        (ignore-errors (format *error-output* "~&[gallop] ~?~%" format-control args)))))

;;; Status codes and their reason phrases: the one table of them (the native
;;; writer's status lines come from it too).

(sb-int:defconstant-eqx +reason-phrases+
  '((100 . "Continue") (101 . "Switching Protocols") (200 . "OK") (201 . "Created")
    (202 . "Accepted") (203 . "Non-Authoritative Information") (204 . "No Content")
    (205 . "Reset Content") (206 . "Partial Content") (300 . "Multiple Choices")
    (301 . "Moved Permanently") (302 . "Found") (303 . "See Other") (304 . "Not Modified")
    (307 . "Temporary Redirect") (308 . "Permanent Redirect") (400 . "Bad Request")
    (401 . "Unauthorized") (402 . "Payment Required") (403 . "Forbidden")
    (404 . "Not Found") (405 . "Method Not Allowed") (406 . "Not Acceptable")
    (408 . "Request Timeout") (409 . "Conflict") (410 . "Gone") (411 . "Length Required")
    (412 . "Precondition Failed") (413 . "Content Too Large") (414 . "URI Too Long")
    (415 . "Unsupported Media Type") (416 . "Range Not Satisfiable")
    (417 . "Expectation Failed") (422 . "Unprocessable Content") (426 . "Upgrade Required")
    (428 . "Precondition Required") (429 . "Too Many Requests")
    (431 . "Request Header Fields Too Large") (500 . "Internal Server Error")
    (501 . "Not Implemented") (502 . "Bad Gateway") (503 . "Service Unavailable")
    (504 . "Gateway Timeout") (505 . "HTTP Version Not Supported"))
  #'equal
  "Status codes and their reason phrases (RFC 9110, section 15).")

;; Evaluated when compiled too: the constants below are made from them.
(eval-when (:compile-toplevel :load-toplevel :execute)
  (defun reason-phrase (status)
    "The reason phrase of STATUS, or \"Status\" for a code without one."
    (or (cdr (assoc status +reason-phrases+)) "Status"))

  ;; Pre-encoded responses the engine writes itself, without a handler.

  (defun encode-ascii (string)
    (map '(simple-array (unsigned-byte 8) (*)) #'char-code string))

  (defun make-error-response (status &key retry-after)
    "The complete answer STATUS (with Retry-After: RETRY-AFTER seconds, if
given) as octets: a short text body, its exact Content-Length, and
Connection: close."
    (let* ((crlf (coerce '(#\Return #\Linefeed) 'string))
           (body (format nil "~D ~A~%" status (reason-phrase status))))
      (encode-ascii
       (concatenate 'string
                    (format nil "HTTP/1.1 ~D ~A" status (reason-phrase status)) crlf
                    "Content-Type: text/plain; charset=utf-8" crlf
                    (format nil "Content-Length: ~D" (length body)) crlf
                    "Connection: close" crlf
                    (if retry-after (format nil "Retry-After: ~D~A" retry-after crlf) "")
                    crlf
                    body)))))

(sb-int:defconstant-eqx +response-400+ (make-error-response 400) #'equalp)
(sb-int:defconstant-eqx +response-408+ (make-error-response 408) #'equalp)
(sb-int:defconstant-eqx +response-413+ (make-error-response 413) #'equalp)
(sb-int:defconstant-eqx +response-414+ (make-error-response 414) #'equalp)
(sb-int:defconstant-eqx +response-501+ (make-error-response 501) #'equalp)
(sb-int:defconstant-eqx +response-505+ (make-error-response 505) #'equalp)
(sb-int:defconstant-eqx +response-431+ (make-error-response 431) #'equalp)

(defun response-status (response)
  "The status code of RESPONSE, one of the engine's own answers."
  (declare (type (simple-array (unsigned-byte 8) (*)) response))
  (+ (* 100 (- (aref response 9) 48)) (* 10 (- (aref response 10) 48)) (- (aref response 11) 48)))

(defun response-body-sent (response sent)
  "The octets of RESPONSE's body (one of the engine's own answers) among its
first SENT octets."
  (declare (type (simple-array (unsigned-byte 8) (*)) response) (type fixnum sent))
  (let ((head (loop for i of-type fixnum from 3 below (length response)
                    when (and (= 10 (aref response i)) (= 13 (aref response (- i 1)))
                              (= 10 (aref response (- i 2))) (= 13 (aref response (- i 3))))
                      return (1+ i)
                    finally (return (length response)))))
    (max 0 (- (min sent (length response)) head))))

(defun error-response (status)
  (ecase status
    (400 +response-400+) (413 +response-413+) (414 +response-414+)
    (431 +response-431+) (501 +response-501+) (505 +response-505+)))

(sb-int:defconstant-eqx +response-100+
    (encode-ascii (format nil "HTTP/1.1 100 Continue~C~C~C~C"
                          #\Return #\Linefeed #\Return #\Linefeed))
  #'equalp
  "The interim answer to Expect: 100-continue.")

(defun error-body-bytes (status)
  "Octets of the body of the engine's own answer STATUS (MAKE-ERROR-RESPONSE)."
  (length (format nil "~D ~A~%" status (reason-phrase status))))

(defun response-503 (engine)
  (or (engine-response-503 engine)
      (setf (engine-response-503 engine)
            (make-error-response 503 :retry-after (engine-retry-after engine)))))
