;;;; soak.lisp -- the soak test behind `make soak` and `make soak-short`.
;;;;
;;;;   scripts/lisp.sh --load bench/soak.lisp --eval '(gallop-soak:main :full)'   ; or :short
;;;;
;;;; Why: a server that passes every unit test can still leak a little per
;;;; request -- a file descriptor on one error path, a thread that never
;;;; retires, a buffer that is never returned -- and that only shows after
;;;; millions of requests of every sort.  This test sends millions of
;;;; requests mixing well-behaved and badly-behaved clients, and checks that
;;;; the server's resident memory, open file descriptors and threads after all
;;;; of them are within 10% of what they were after a warm-up.
;;;;
;;;; What it does, for each server kind in turn (bench/server.lisp's `gallop`,
;;;; GALLOP:EASY-ACCEPTOR, and `native`, GALLOP:START), each in its own SBCL
;;;; child process on 127.0.0.1:
;;;;
;;;;  1. warm-up: the traffic mix below until WARM-UP-FRACTION (10%) of the
;;;;     kind's request target has been served;
;;;;  2. quiesce and sample: wait until the server's stats show no open
;;;;     connection, nothing in flight or pending; then 5 s more, so that the
;;;;     pool has retired its extra idle workers and the timing wheel has
;;;;     dropped the closed connections it still holds until their deadlines
;;;;     (the servers run with a thread idle timeout of 2 s and read, write,
;;;;     header and idle timeouts of 4 s instead of 10 s and 20 s:
;;;;     BENCH_THREAD_IDLE_TIMEOUT and BENCH_TIMEOUT); then until the thread
;;;;     count holds still; ask the server for a full GC (the "gc" command of
;;;;     bench/server.lisp), then read VmRSS from /proc/PID/status and count
;;;;     /proc/PID/fd and /proc/PID/task;
;;;;  3. the rest of the traffic, up to the request target;
;;;;  4. quiesce and sample again, exactly as in 2;
;;;;  5. check: every end value is at most TOLERANCE (1.10) x its warm-up
;;;;     value (lower is fine), the server still answers GET /yo with 200, and
;;;;     every slow client got 200 with the right body.
;;;;
;;;; The traffic mix, all running at once, to 127.0.0.1 only:
;;;;  - keep-alive: `wrk -c64 /yo`;
;;;;  - Connection: close: `wrk -c16 -H "Connection: close" /yo`;
;;;;  - slow clients (Lisp threads): trickle each request head a few bytes at a
;;;;    time with pauses of a few ms, one to three requests per connection,
;;;;    then read the whole response and check it is 200 "Hey slowN!";
;;;;  - aborted clients (Lisp threads): (a) send part of a request head and
;;;;    close; (b) send a whole request and reset the connection (SO_LINGER 0,
;;;;    close) before reading the answer; (c) GET /big (1 MiB) and close after
;;;;    reading only part of it.
;;;; wrk runs in rounds of a few seconds, sized from the rate so far, until
;;;; the target is reached; each phase also has a time limit, and missing the
;;;; target within it is a failure.  Requests counted toward the target are
;;;; wrk's completed requests plus the slow clients' completed ones (per
;;;; server kind); the aborted clients' attempts are reported beside them but
;;;; not counted.
;;;;
;;;;   mode     requests per kind   kinds           about
;;;;   :full    2,000,000           gallop, native  3 min
;;;;   :short     200,000           gallop, native  < 1 min (CI)
;;;;
;;;; Environment overrides: SOAK_REQUESTS (per kind), SOAK_KINDS (e.g.
;;;; "native"), SOAK_PORT (base port; kind N uses PORT+N, default 18180).
;;;; Servers log errors (BENCH_MESSAGE_LOG=1) to
;;;; bench/results/tmp/logs/soak-RUN-KIND.log; the report counts the lines
;;;; they logged while serving.
;;;;
;;;; Exit code: 0 when every kind passed, 1 when a check failed, 2 when the
;;;; harness itself broke.

(require :sb-bsd-sockets)

(load (merge-pathnames "process.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-soak
  (:use #:common-lisp #:gallop-bench-process)
  (:export #:main))
(in-package #:gallop-soak)

(defparameter *bench-dir*
  (make-pathname :name nil :type nil :version nil
                 :defaults (or *load-truename* *default-pathname-defaults*)))

;;; Configuration

(defstruct (plan (:conc-name plan-))
  "What one soak run does."
  mode
  kinds                     ; server kinds of bench/server.lisp, soaked one after the other
  requests                  ; counted requests per kind
  (warm-up-fraction 1/10)   ; of REQUESTS, served before the first sample
  warm-up-time-limit        ; seconds
  main-time-limit           ; seconds
  (keep-alive-connections 64)
  (close-connections 16)
  (slow-clients 8)          ; threads
  (aborters-per-sort 1)     ; threads for each of the three sorts of aborted client
  (tolerance 11/10)         ; end value <= TOLERANCE x warm-up value
  (thread-idle-timeout 2)   ; seconds, given to the servers (BENCH_THREAD_IDLE_TIMEOUT)
  (server-timeout 4)        ; seconds: their read, write, header and idle timeouts (BENCH_TIMEOUT)
  (quiesce-timeout 45)      ; seconds to wait for the server to close every connection
  port)

(defparameter *kinds* '("gallop" "native")
  "The server kinds soaked, by bench/server.lisp's names.")

(defun make-plan-for (mode)
  (multiple-value-bind (requests warm-up-limit main-limit)
      (ecase mode
        (:full (values 2000000 180 900))
        (:short (values 200000 30 60)))
    (make-plan :mode mode
               :kinds (env-choices "SOAK_KINDS" "kind" *kinds* *kinds*)
               :requests (max 1000 (env-int "SOAK_REQUESTS" requests))
               :warm-up-time-limit warm-up-limit
               :main-time-limit main-limit
               :port (env-int "SOAK_PORT" 18180))))

(defun kind-port (plan kind)
  (+ (plan-port plan) 1 (position kind *kinds* :test #'string=)))

;;; Progress output

(defun say (control &rest args)
  "A progress line, prefixed with the time since the start."
  (format t "~&[~A] ~?~%" (clock (elapsed)) control args)
  (finish-output))

(defun fmt-int (n)
  (if (integerp n) (format nil "~:D" n) (format nil "~A" (or n "-"))))

;;; Child processes

(defun file-size (path)
  (or (ignore-errors
       (with-open-file (in path :element-type '(unsigned-byte 8)) (file-length in)))
      0))

;;; The server under test

(defstruct (server (:conc-name server-))
  "A bench/server.lisp child process."
  kind port process pid log (log-start 0))

(defun server-environment (plan)
  "This process's environment, with error logging on and the soak's timeouts."
  (environment-with (list "BENCH_MESSAGE_LOG=1"
                          (format nil "BENCH_THREAD_IDLE_TIMEOUT=~D" (plan-thread-idle-timeout plan))
                          (format nil "BENCH_TIMEOUT=~D" (plan-server-timeout plan)))
                    :drop '("BENCH_IDLE_TIMEOUT")))

(defun start-server (plan kind log)
  "Start bench/server.lisp as KIND and wait for READY.  The server, or an error."
  (let ((port (kind-port plan kind)))
    (multiple-value-bind (process pid)
        (start-bench-server kind port :environment (server-environment plan) :log log)
      (make-server :kind kind :port port :process process :pid pid
                   :log log :log-start (file-size log)))))

(defun server-stats (server)
  "GALLOP:STATS of SERVER as a property list, or NIL."
  (ask-stats (server-process server) 30))

(defun server-log-lines (server)
  "The non-blank lines SERVER wrote to its log after it said READY."
  (with-open-file (in (server-log server) :element-type '(unsigned-byte 8) :if-does-not-exist nil)
    (when in
      (file-position in (min (server-log-start server) (file-length in)))
      (let ((octets (make-array (- (file-length in) (file-position in))
                                :element-type '(unsigned-byte 8))))
        (read-sequence octets in)
        (remove-if (lambda (line) (string= (string-trim '(#\Space #\Return) line) ""))
                   (uiop:split-string (map 'string #'code-char octets)
                                      :separator '(#\Newline)))))))

;;; /proc

(defun thread-count (pid)
  "Threads of PID: the entries of /proc/PID/task."
  (length (directory (format nil "/proc/~D/task/*/" pid) :resolve-symlinks nil)))

;;; A minimal HTTP/1.1 client over sb-bsd-sockets, for the Lisp clients

(define-condition client-failure (simple-error) ()
  (:documentation "A client saw something other than what a correct server sends."))

(defun client-fail (control &rest args)
  (error 'client-failure :format-control control :format-arguments args))

(defun octets (string)
  (map '(simple-array (unsigned-byte 8) (*)) #'char-code string))

(defstruct (conn (:constructor %make-conn (socket fd)))
  "A client connection and the bytes received on it not consumed yet."
  socket fd
  (scratch (make-array 16384 :element-type '(unsigned-byte 8)))
  (received (make-array 4096 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))

(defun connect (port)
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (handler-bind ((error (lambda (e) (declare (ignore e)) (sb-bsd-sockets:socket-close socket))))
      (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port))
    (%make-conn socket (sb-bsd-sockets:socket-file-descriptor socket))))

(defmacro with-conn ((var port) &body body)
  `(let ((,var (connect ,port)))
     (unwind-protect (progn ,@body)
       (ignore-errors (sb-bsd-sockets:socket-close (conn-socket ,var))))))

(defun send-octets (conn octets &key (start 0) (end (length octets)))
  "Send OCTETS[START, END) on CONN, all of them."
  (loop while (< start end)
        do (let ((n (sb-bsd-sockets:socket-send (conn-socket conn) (subseq octets start end) nil
                                                :nosignal t)))
             (unless (and n (plusp n))
               (client-fail "send failed"))
             (incf start n))))

(defun receive-more (conn deadline)
  "Append what arrives on CONN to its received bytes.  The number of bytes
read, 0 at end of file; a CLIENT-FAILURE when nothing came by DEADLINE
(internal real time)."
  (let ((left (/ (- deadline (get-internal-real-time)) internal-time-units-per-second)))
    (unless (and (plusp left)
                 (sb-sys:wait-until-fd-usable (conn-fd conn) :input (float left 1d0)))
      (client-fail "no answer within the deadline")))
  (let ((buffer (conn-scratch conn)))
    (multiple-value-bind (data n) (sb-bsd-sockets:socket-receive (conn-socket conn) buffer nil)
      (declare (ignore data))
      (let* ((n (or n 0))
             (received (conn-received conn))
             (old (fill-pointer received)))
        (when (plusp n)
          (when (> (+ old n) (array-dimension received 0))
            (setf received (adjust-array received (* 2 (+ old n))))
            (setf (conn-received conn) received))
          (setf (fill-pointer received) (+ old n))
          (replace received buffer :start1 old :end2 n))
        n))))

(defun consume (conn n)
  "Drop the first N received bytes of CONN."
  (let ((received (conn-received conn)))
    (replace received received :start2 n)
    (decf (fill-pointer received) n)))

(defun find-crlf (octets start &optional (end (length octets)))
  (loop for i from start below (1- end)
        when (and (= (aref octets i) 13) (= (aref octets (1+ i)) 10))
          return i))

(defun ensure-received (conn n deadline what)
  "Receive until CONN holds at least N bytes."
  (loop while (< (fill-pointer (conn-received conn)) n)
        do (when (zerop (receive-more conn deadline))
             (client-fail "connection closed in the middle of ~A" what))))

(defun read-line-octets (conn deadline what)
  "The next CRLF-terminated line received on CONN, as a string, consumed."
  (loop
    (let* ((received (conn-received conn))
           (crlf (find-crlf received 0)))
      (when crlf
        (let ((line (map 'string #'code-char (subseq received 0 crlf))))
          (consume conn (+ crlf 2))
          (return line)))
      (when (> (fill-pointer received) 65536)
        (client-fail "~A: a line longer than 64 KiB" what))
      (when (zerop (receive-more conn deadline))
        (client-fail "connection closed in the middle of ~A" what)))))

(defun take (conn n)
  "The first N received bytes of CONN (they must be there), consumed."
  (prog1 (subseq (conn-received conn) 0 n)
    (consume conn n)))

(defun read-response (conn deadline)
  "Read one whole response on CONN.  Its status code, body (octets), and
whether the server said it closes the connection."
  (let* ((status-line (read-line-octets conn deadline "the status line"))
         (status (and (uiop:string-prefix-p "HTTP/1." status-line)
                      (parse-integer status-line :start 9 :end (min 12 (length status-line))
                                                 :junk-allowed t)))
         (length nil) (chunked nil) (close nil))
    (unless status
      (client-fail "bad status line ~S" status-line))
    (loop for line = (read-line-octets conn deadline "the response head")
          until (string= line "")
          do (let* ((colon (or (position #\: line) (client-fail "bad header line ~S" line)))
                    (name (string-downcase (subseq line 0 colon)))
                    (value (string-trim " " (subseq line (1+ colon)))))
               (cond ((string= name "content-length")
                      (setf length (parse-integer value)))
                     ((string= name "transfer-encoding")
                      (setf chunked (search "chunked" (string-downcase value))))
                     ((string= name "connection")
                      (setf close (search "close" (string-downcase value)))))))
    (values status
            (cond (chunked
                   (let ((body (make-array 0 :element-type '(unsigned-byte 8) :adjustable t
                                             :fill-pointer 0)))
                     (loop for size = (parse-integer (read-line-octets conn deadline "a chunk size")
                                                     :radix 16 :junk-allowed t)
                           do (unless size (client-fail "bad chunk size"))
                              (when (zerop size)
                                ;; No trailers are sent; the chunked body ends with an empty line.
                                (read-line-octets conn deadline "the last chunk")
                                (return))
                              (ensure-received conn (+ size 2) deadline "a chunk")
                              (loop for octet across (take conn size)
                                    do (vector-push-extend octet body))
                              (consume conn 2))
                     (coerce body '(simple-array (unsigned-byte 8) (*)))))
                  (length
                   (ensure-received conn length deadline "the body")
                   (take conn length))
                  (t
                   ;; Delimited by the end of the connection.
                   (loop until (zerop (receive-more conn deadline)))
                   (take conn (fill-pointer (conn-received conn)))))
            close)))

(defun request-head (target &key close (agent "gallop-soak"))
  (format nil "GET ~A HTTP/1.1~C~CHost: 127.0.0.1~C~CUser-Agent: ~A~C~C~:[~;Connection: close~C~C~]~C~C"
          target #\Return #\Linefeed #\Return #\Linefeed agent #\Return #\Linefeed
          close #\Return #\Linefeed #\Return #\Linefeed))

(defun deadline-in (seconds)
  (+ (get-internal-real-time) (* seconds internal-time-units-per-second)))

(defun reset-on-close (conn)
  "Make closing CONN send RST instead of FIN: SO_LINGER on, 0 s."
  (sb-alien:with-alien ((linger (array (sb-alien:signed 32) 2)))
    (setf (sb-alien:deref linger 0) 1
          (sb-alien:deref linger 1) 0)
    (let ((result (sb-alien:alien-funcall
                   (sb-alien:extern-alien "setsockopt"
                                          (function sb-alien:int sb-alien:int sb-alien:int sb-alien:int
                                                    sb-sys:system-area-pointer sb-alien:unsigned))
                   (conn-fd conn) 1 13    ; SOL_SOCKET, SO_LINGER
                   (sb-alien:alien-sap linger) 8)))
      (unless (zerop result)
        (error "setsockopt(SO_LINGER) failed")))))

(defun get-yo (port)
  "A plain GET /yo on a fresh connection: the status and body text."
  (with-conn (conn port)
    (send-octets conn (octets (request-head "/yo" :close t)))
    (multiple-value-bind (status body) (read-response conn (deadline-in 10))
      (values status (map 'string #'code-char body)))))

;;; The Lisp clients

(defstruct (counts (:conc-name counts-))
  "What the Lisp clients did, counted atomically by all of them."
  (slow-ok 0 :type sb-ext:word)          ; slow requests answered 200 with the right body
  (slow-failed 0 :type sb-ext:word)
  (half-head 0 :type sb-ext:word)        ; (a)
  (reset 0 :type sb-ext:word)            ; (b)
  (partial 0 :type sb-ext:word)          ; (c)
  (abort-anomalies 0 :type sb-ext:word)  ; an aborting client saw something unexpected
  (lock (sb-thread:make-mutex :name "soak client notes"))
  (notes '()))                           ; the first few failures and anomalies, text

(defparameter *max-notes* 10
  "How many failure and anomaly texts a phase keeps for the report.")

(defun note (counts control &rest args)
  "Keep a failure or anomaly text for the report (the first *MAX-NOTES*)."
  (sb-thread:with-mutex ((counts-lock counts))
    (when (< (length (counts-notes counts)) *max-notes*)
      (push (format nil "~?" control args) (counts-notes counts)))))

(defun pause-ms (random-state low high)
  "Sleep between LOW and HIGH milliseconds."
  (sleep (/ (+ low (random (1+ (- high low)) random-state)) 1000)))

(defun slow-connection (port id counts rs)
  "One connection of slow client ID: one to three requests, each head
trickled a few bytes at a time, the last with Connection: close; each
response read whole and checked."
  (with-conn (conn port)
    (let ((n (1+ (random 3 rs)))
          (expected (format nil "Hey slow~D!" id)))
      (dotimes (i n)
        (let* ((last (= i (1- n)))
               (head (octets (request-head (format nil "/yo?name=slow~D" id)
                                           :close last :agent "gallop-soak-slow"))))
          (loop with start = 0
                while (< start (length head))
                do (let ((end (min (length head) (+ start 1 (random 8 rs)))))
                     (send-octets conn head :start start :end end)
                     (setf start end)
                     (pause-ms rs 1 10)))
          (multiple-value-bind (status body closing) (read-response conn (deadline-in 30))
            (let ((text (map 'string #'code-char body)))
              (unless (and (eql status 200) (string= text expected))
                (client-fail "slow client ~D: got ~A ~S, expected 200 ~S" id status text expected)))
            (sb-ext:atomic-incf (counts-slow-ok counts))
            ;; A server may end a keep-alive connection whenever it says so.
            (when closing
              (return))))))))

(defun half-head (port counts rs)
  "(a) Send part of a request head, then close normally."
  (with-conn (conn port)
    (let ((head (octets (request-head "/yo?name=half" :agent "gallop-soak-half"))))
      (send-octets conn head :end (1+ (random (1- (length head)) rs)))
      (when (zerop (random 2 rs))
        (pause-ms rs 0 20))))
  (sb-ext:atomic-incf (counts-half-head counts)))

(defun reset-request (port counts rs)
  "(b) Send a whole request (for /yo or /big), then reset the connection
without reading the answer, at once or after up to 3 ms."
  (with-conn (conn port)
    (send-octets conn (octets (request-head (if (zerop (random 2 rs)) "/yo?name=reset" "/big")
                                            :agent "gallop-soak-reset")))
    (when (zerop (random 2 rs))
      (pause-ms rs 0 3))
    (reset-on-close conn))
  (sb-ext:atomic-incf (counts-reset counts)))

(defun partial-big (port counts rs)
  "(c) GET /big (1 MiB), read between 1 byte and 512 KiB of the answer,
close.  The unread bytes make the kernel reset the connection, so the
server's writes fail in mid-response."
  (with-conn (conn port)
    (send-octets conn (octets (request-head "/big" :agent "gallop-soak-partial")))
    (let ((want (1+ (random (* 512 1024) rs)))
          (deadline (deadline-in 30)))
      (loop while (< (fill-pointer (conn-received conn)) want)
            do (when (zerop (receive-more conn deadline))
                 (client-fail "partial /big: the server closed after ~D bytes"
                              (fill-pointer (conn-received conn)))))
      (let ((received (conn-received conn)))
        (when (and (>= (fill-pointer received) 12)
                   (not (string= (map 'string #'code-char (subseq received 0 12)) "HTTP/1.1 200")))
          (client-fail "partial /big: answer starts with ~S"
                       (map 'string #'code-char (subseq received 0 12)))))))
  (sb-ext:atomic-incf (counts-partial counts)))

(defun client-thread (name port counts stop step &key slow)
  "A thread running STEP (PORT COUNTS RANDOM-STATE) until STOP's car is true.
Errors of slow clients are failures; errors of aborting clients anomalies."
  (sb-thread:make-thread
   (lambda ()
     (let ((rs (make-random-state t)))
       (loop until (car stop)
             do (handler-case (funcall step port counts rs)
                  (error (e)
                    (if slow
                        (sb-ext:atomic-incf (counts-slow-failed counts))
                        (sb-ext:atomic-incf (counts-abort-anomalies counts)))
                    (note counts "~A: ~A" name e)
                    (pause-ms rs 50 100)))
                (unless slow
                  (pause-ms rs 2 10))))
     :done)
   :name name))

(defun start-clients (plan port counts stop)
  "Start the slow and aborting client threads; they run until STOP's car is true."
  (append
   (loop for id from 1 to (plan-slow-clients plan)
         collect (let ((id id))
                   (client-thread (format nil "slow ~D" id) port counts stop
                                  (lambda (port counts rs) (slow-connection port id counts rs))
                                  :slow t)))
   (loop repeat (plan-aborters-per-sort plan)
         append (list (client-thread "half head" port counts stop #'half-head)
                      (client-thread "reset" port counts stop #'reset-request)
                      (client-thread "partial /big" port counts stop #'partial-big)))))

(defun stop-clients (threads stop)
  "Stop the client threads.  The names of those that did not end within 60 s
(stuck on the server), which are then terminated."
  (setf (car stop) t)
  (let ((deadline (deadline-in 60)))
    (loop for thread in threads
          unless (eq :done (sb-thread:join-thread
                            thread :default :stuck
                                   :timeout (max 0.1 (/ (- deadline (get-internal-real-time))
                                                        internal-time-units-per-second))))
            collect (progn (ignore-errors (sb-thread:terminate-thread thread))
                           (sb-thread:thread-name thread)))))

;;; wrk

(defun wrk-output-path (run-id kind which)
  (merge-pathnames (format nil "logs/soak-~A-~A-wrk-~A.txt" run-id kind which)
                   (merge-pathnames "results/tmp/" *bench-dir*)))

(defun start-wrk (port connections close seconds output)
  "wrk against /yo for SECONDS (killed if it runs 30 s longer), output to OUTPUT."
  (sb-ext:run-program "timeout"
                      (append (list "-k" "5" (princ-to-string (+ seconds 30))
                                    "wrk" "-t1" (format nil "-c~D" connections)
                                    (format nil "-d~Ds" seconds) "--timeout" "5s")
                              (and close (list "-H" "Connection: close"))
                              (list (format nil "http://127.0.0.1:~D/yo" port)))
                      :search t :wait nil :input nil
                      :output (namestring output) :if-output-exists :supersede
                      :error :output))

(defun finish-wrk (process output seconds)
  "Wait for the wrk PROCESS; its parsed report, or an error."
  (unless (wait-exit process (+ seconds 40))
    (kill-and-reap process)
    (error "wrk did not finish"))
  (let ((code (sb-ext:process-exit-code process)))
    (ignore-errors (sb-ext:process-close process))
    (let* ((text (or (ignore-errors (uiop:read-file-string output)) ""))
           (report (let ((r (parse-wrk text))) (and (getf r :requests) r))))
      (or report
          (error "wrk exited with ~A and no report: ~A" code
                 (string-trim '(#\Newline #\Space) text))))))

;;; Traffic phases

(defstruct (traffic (:conc-name traffic-))
  "What one phase of traffic, or the sum of several, did."
  (keep-alive 0) (close 0)          ; wrk's completed requests
  (slow 0) (slow-failed 0)
  (half-head 0) (reset 0) (partial 0) (abort-anomalies 0)
  (wrk-errors (list :connect 0 :read 0 :write 0 :timeout 0))
  (non2xx 0)
  (seconds 0) (rounds 0)
  (notes '()))

(defun traffic-counted (traffic)
  "The requests that count toward the target."
  (+ (traffic-keep-alive traffic) (traffic-close traffic) (traffic-slow traffic)))

(defun traffic-socket-errors (traffic)
  (loop for (nil v) on (traffic-wrk-errors traffic) by #'cddr sum v))

(defun add-wrk-report (traffic report which)
  (if (eq which :close)
      (incf (traffic-close traffic) (getf report :requests))
      (incf (traffic-keep-alive traffic) (getf report :requests)))
  (incf (traffic-non2xx traffic) (getf report :non2xx))
  (dolist (key '(:connect :read :write :timeout))
    (incf (getf (traffic-wrk-errors traffic) key) (getf report key))))

(defun sum-traffic (a b)
  "A TRAFFIC adding up A and B."
  (flet ((sum (reader) (+ (funcall reader a) (funcall reader b))))
    (make-traffic :keep-alive (sum #'traffic-keep-alive) :close (sum #'traffic-close)
                  :slow (sum #'traffic-slow) :slow-failed (sum #'traffic-slow-failed)
                  :half-head (sum #'traffic-half-head) :reset (sum #'traffic-reset)
                  :partial (sum #'traffic-partial) :abort-anomalies (sum #'traffic-abort-anomalies)
                  :non2xx (sum #'traffic-non2xx) :seconds (sum #'traffic-seconds)
                  :rounds (sum #'traffic-rounds)
                  :wrk-errors (loop for key in '(:connect :read :write :timeout)
                                    append (list key (+ (getf (traffic-wrk-errors a) key)
                                                        (getf (traffic-wrk-errors b) key))))
                  :notes (append (traffic-notes a) (traffic-notes b)))))

(defun round-seconds (remaining rate)
  "How long the next wrk round runs: what RATE (requests/s, NIL before the
first round) needs for REMAINING requests, between 1 and 15 s."
  (if (and rate (plusp rate))
      (max 1 (min 15 (ceiling (* 1.02 remaining) rate)))
      1))

(defun run-phase (plan server run-id label target time-limit)
  "Run the whole traffic mix against SERVER until TARGET requests are counted
or TIME-LIMIT seconds passed.  The TRAFFIC, and a failure text or NIL."
  (let* ((port (server-port server))
         (traffic (make-traffic))
         (counts (make-counts))
         (stop (list nil))
         (started (get-internal-real-time))
         (failure nil)
         (threads (start-clients plan port counts stop)))
    (flet ((seconds-so-far ()
             (/ (- (get-internal-real-time) started) internal-time-units-per-second))
           (counted ()
             (+ (traffic-keep-alive traffic) (traffic-close traffic) (counts-slow-ok counts))))
      (unwind-protect
           (handler-case
               (loop with rate = nil
                     for remaining = (- target (counted))
                     while (plusp remaining)
                     do (when (> (seconds-so-far) time-limit)
                          (setf failure (format nil "~A: only ~:D of ~:D requests within ~D s"
                                                label (counted) target time-limit))
                          (return))
                        (let* ((seconds (round-seconds remaining rate))
                               (before (counted))
                               (round-start (get-internal-real-time))
                               (ka-out (wrk-output-path run-id (server-kind server) "keep-alive"))
                               (close-out (wrk-output-path run-id (server-kind server) "close"))
                               (ka (start-wrk port (plan-keep-alive-connections plan) nil seconds
                                              (ensure-directories-exist ka-out)))
                               (close (start-wrk port (plan-close-connections plan) t seconds
                                                 close-out)))
                          (add-wrk-report traffic (finish-wrk ka ka-out seconds) :keep-alive)
                          (add-wrk-report traffic (finish-wrk close close-out seconds) :close)
                          (incf (traffic-rounds traffic))
                          (setf rate (/ (- (counted) before)
                                        (max 0.5 (/ (- (get-internal-real-time) round-start)
                                                    internal-time-units-per-second))))
                          (say "~A ~A: ~:D/~:D requests (~:D req/s; slow ~:D, aborted ~:D)"
                               (server-kind server) label (counted) target (round rate)
                               (counts-slow-ok counts)
                               (+ (counts-half-head counts) (counts-reset counts)
                                  (counts-partial counts)))
                          (unless (alive-p (server-process server))
                            (setf failure (format nil "~A: the server process died (exit code ~A)"
                                                  label (sb-ext:process-exit-code
                                                         (server-process server))))
                            (return))))
             (error (e)
               (setf failure (format nil "~A: ~A" label e))))
        (let ((stuck (stop-clients threads stop)))
          (when stuck
            (let ((text (format nil "~A: client threads still stuck after 60 s: ~{~A~^, ~}"
                                label stuck)))
              (setf failure (if failure (format nil "~A; ~A" failure text) text)))))
        (setf (traffic-slow traffic) (counts-slow-ok counts)
              (traffic-slow-failed traffic) (counts-slow-failed counts)
              (traffic-half-head traffic) (counts-half-head counts)
              (traffic-reset traffic) (counts-reset counts)
              (traffic-partial traffic) (counts-partial counts)
              (traffic-abort-anomalies traffic) (counts-abort-anomalies counts)
              (traffic-notes traffic) (reverse (counts-notes counts))
              (traffic-seconds traffic) (seconds-so-far))))
    (values traffic failure)))

;;; Quiescing and sampling

(defstruct (sample (:conc-name sample-))
  "The server's resources at one quiet moment."
  label rss-kib fds threads dynamic-bytes stats quiesce-seconds)

(defun quiet-p (stats)
  (and stats
       (eql 0 (getf stats :open))
       (eql 0 (getf stats :in-flight))
       (eql 0 (getf stats :pending))))

(defun settle-seconds (plan)
  "How long after the last connection closed a server holds nothing of the
traffic any more: its pool's idle workers beyond the standby count have
left (thread idle timeout), and the timing wheel has dropped the entries of
closed connections, which it keeps until their header or idle deadline,
that is up to the server timeout after they closed."
  (+ 1 (max (plan-thread-idle-timeout plan) (plan-server-timeout plan))))

(defun quiesce (plan server)
  "Wait until SERVER has no open connection, nothing in flight or pending,
then SETTLE-SECONDS, then until its thread count holds still.  Seconds
waited for the connections, or an error."
  (let ((start (get-internal-real-time))
        (deadline (deadline-in (plan-quiesce-timeout plan)))
        (stats nil))
    (loop until (quiet-p (setf stats (server-stats server)))
          do (when (> (get-internal-real-time) deadline)
               (error "still busy ~D s after the traffic stopped: ~S"
                      (plan-quiesce-timeout plan) stats))
             (unless (alive-p (server-process server))
               (error "the server process died"))
             (sleep 0.2))
    (prog1 (/ (- (get-internal-real-time) start) internal-time-units-per-second)
      (sleep (settle-seconds plan))
      (loop with deadline = (deadline-in 20)
            with last = nil and same = 0
            for now = (thread-count (server-pid server))
            do (if (eql now last) (incf same) (setf same 0 last now))
               (when (or (>= same 2) (> (get-internal-real-time) deadline))
                 (return))
               (sleep 0.5)))))

(defun take-sample (plan server label)
  "Quiesce SERVER, collect its garbage, and read its resources."
  (let ((waited (quiesce plan server))
        (dynamic (or (ask-gc (server-process server)) (error "the server did not answer \"gc\""))))
    (sleep 0.5)
    (let ((pid (server-pid server)))
      (make-sample :label label :rss-kib (proc-field pid "VmRSS") :fds (fd-count pid)
                   :threads (thread-count pid) :dynamic-bytes dynamic
                   :stats (server-stats server) :quiesce-seconds waited))))

(defun print-sample (kind sample)
  (let ((stats (sample-stats sample)))
    (say "~A ~A sample: RSS ~:D KiB, ~D fds, ~D threads (pool ~A, idle ~A), dynamic space ~,1F MiB; ~
          quiet after ~,1F s; server totals: accepted ~A, requests ~A, aborted ~A, rejected ~A, timeouts ~A"
         kind (sample-label sample) (sample-rss-kib sample) (sample-fds sample)
         (sample-threads sample) (getf stats :threads) (getf stats :idle-threads)
         (/ (sample-dynamic-bytes sample) 1048576) (sample-quiesce-seconds sample)
         (fmt-int (getf stats :accepted)) (fmt-int (getf stats :requests))
         (fmt-int (getf stats :aborted)) (fmt-int (getf stats :rejected))
         (fmt-int (getf stats :timeouts)))))

;;; One server kind

(defstruct (outcome (:conc-name outcome-))
  "How one server kind did."
  kind warm-up end traffic failures (log-lines '()) (seconds 0) final-check)

(defparameter *metrics*
  '(("RSS KiB" . sample-rss-kib) ("fds" . sample-fds) ("threads" . sample-threads))
  "The resources compared between the warm-up and end samples.")

(defun check-growth (plan outcome)
  "Failure texts for every metric whose end value exceeds TOLERANCE x warm-up."
  (let ((warm (outcome-warm-up outcome))
        (end (outcome-end outcome)))
    (when (and warm end)
      (loop for (name . reader) in *metrics*
            for before = (funcall reader warm)
            for after = (funcall reader end)
            unless (and before after (<= after (* (plan-tolerance plan) before)))
              collect (format nil "~A grew from ~A to ~A (limit ~,2Fx)"
                              name before after (plan-tolerance plan))))))

(defun soak-kind (plan run-id kind)
  "Soak one server KIND; its OUTCOME."
  (let* ((log (ensure-directories-exist
               (merge-pathnames (format nil "results/tmp/logs/soak-~A-~A.log" run-id kind)
                                *bench-dir*)))
         (outcome (make-outcome :kind kind :traffic (make-traffic)))
         (kind-start (get-internal-real-time))
         (server nil))
    (flet ((fail (text)
             (say "~A: FAILURE: ~A" kind text)
             (setf (outcome-failures outcome) (append (outcome-failures outcome) (list text))))
           (traffic-phase (label target limit)
             (multiple-value-bind (traffic failure)
                 (run-phase plan server run-id label target limit)
               (setf (outcome-traffic outcome) (sum-traffic (outcome-traffic outcome) traffic))
               failure)))
      (unwind-protect
           (block soak
             (say "~A: starting the server (bench/server.lisp ~A, port ~D)"
                  kind kind (kind-port plan kind))
             (setf server (start-server plan kind log))
             (let* ((total (plan-requests plan))
                    (warm-up (max 1 (round (* total (plan-warm-up-fraction plan))))))
               (let ((failure (traffic-phase "warm-up" warm-up (plan-warm-up-time-limit plan))))
                 (when failure (fail failure) (return-from soak)))
               (handler-case (setf (outcome-warm-up outcome) (take-sample plan server "warm-up"))
                 (error (e) (fail (format nil "after the warm-up: ~A" e)) (return-from soak)))
               (print-sample kind (outcome-warm-up outcome))
               (let ((failure (traffic-phase "main" (- total (traffic-counted (outcome-traffic outcome)))
                                             (plan-main-time-limit plan))))
                 (when failure (fail failure))
                 (unless (alive-p (server-process server))
                   (return-from soak)))
               (handler-case (setf (outcome-end outcome) (take-sample plan server "end"))
                 (error (e) (fail (format nil "after the traffic: ~A" e)) (return-from soak)))
               (print-sample kind (outcome-end outcome))
               (dolist (text (check-growth plan outcome)) (fail text))
               (multiple-value-bind (status body)
                   (handler-case (get-yo (server-port server))
                     (error (e) (values nil (princ-to-string e))))
                 (setf (outcome-final-check outcome) (format nil "~A ~S" status body))
                 (unless (and (eql status 200) (string= body "Hey!"))
                   (fail (format nil "final GET /yo: ~A ~S, expected 200 \"Hey!\"" status body))))
               (let ((slow-failed (traffic-slow-failed (outcome-traffic outcome))))
                 (when (plusp slow-failed)
                   (fail (format nil "~:D slow request~:P did not get 200 with the right body"
                                 slow-failed))))
               (when (< (traffic-counted (outcome-traffic outcome)) total)
                 (fail (format nil "~:D requests counted, fewer than ~:D"
                               (traffic-counted (outcome-traffic outcome)) total)))))
        (when server
          (quit-process (server-process server))
          (setf (outcome-log-lines outcome) (server-log-lines server)))
        (setf (outcome-seconds outcome)
              (/ (- (get-internal-real-time) kind-start) internal-time-units-per-second))))
    outcome))

;;; The report

(defun ratio-text (before after)
  (if (and before after (plusp before))
      (format nil "~,3F" (/ after before))
      "-"))

(defun print-samples (plan outcomes)
  (format t "~&~%Samples (after quiescing, a full GC; end must be <= ~,2F x warm-up):~%~%"
          (plan-tolerance plan))
  (format t "~&| kind | sample | RSS KiB | fds | threads | dynamic space MiB | pool threads |~%")
  (format t "~&|---|---|--:|--:|--:|--:|--:|~%")
  (dolist (o outcomes)
    (let ((warm (outcome-warm-up o)) (end (outcome-end o)))
      (dolist (s (remove nil (list warm end)))
        (format t "~&| ~A | ~A | ~A | ~A | ~A | ~,1F | ~A |~%"
                (outcome-kind o) (sample-label s) (fmt-int (sample-rss-kib s))
                (sample-fds s) (sample-threads s) (/ (sample-dynamic-bytes s) 1048576)
                (getf (sample-stats s) :threads)))
      (when (and warm end)
        (format t "~&| ~A | end / warm-up | ~A | ~A | ~A | ~A | |~%"
                (outcome-kind o)
                (ratio-text (sample-rss-kib warm) (sample-rss-kib end))
                (ratio-text (sample-fds warm) (sample-fds end))
                (ratio-text (sample-threads warm) (sample-threads end))
                (ratio-text (sample-dynamic-bytes warm) (sample-dynamic-bytes end)))))))

(defun print-traffic (outcomes)
  (let ((rows `(("keep-alive (wrk)" . traffic-keep-alive)
                ("Connection: close (wrk)" . traffic-close)
                ("slow, 200 (Lisp)" . traffic-slow)
                ("counted" . traffic-counted)
                ("aborted: half head (not counted)" . traffic-half-head)
                ("aborted: reset (not counted)" . traffic-reset)
                ("aborted: partial /big (not counted)" . traffic-partial)
                ("slow failures" . traffic-slow-failed)
                ("aborting clients' anomalies" . traffic-abort-anomalies)
                ("wrk non-2xx" . traffic-non2xx)
                ("wrk socket errors" . traffic-socket-errors))))
    (format t "~&~%Requests by client type (per server kind):~%~%")
    (format t "~&| client | ~{~A~^ | ~} | all |~%" (mapcar #'outcome-kind outcomes))
    (format t "~&|---|~{~A~}--:|~%" (mapcar (constantly "--:|") outcomes))
    (loop for (label . reader) in rows
          for values = (mapcar (lambda (o) (funcall reader (outcome-traffic o))) outcomes)
          do (format t "~&| ~A | ~{~A~^ | ~} | ~A |~%"
                     label (mapcar #'fmt-int values) (fmt-int (reduce #'+ values))))
    (format t "~&| traffic time | ~{~A~^ | ~} | ~A |~%"
            (mapcar (lambda (o) (clock (traffic-seconds (outcome-traffic o)))) outcomes)
            (clock (reduce #'+ outcomes :key (lambda (o) (traffic-seconds (outcome-traffic o))))))
    (dolist (o outcomes)
      (let ((errors (traffic-wrk-errors (outcome-traffic o))))
        (when (plusp (traffic-socket-errors (outcome-traffic o)))
          (format t "~&~A: wrk socket errors ~{~(~A~) ~A~^, ~}~%" (outcome-kind o) errors))))))

(defun print-outcome-notes (outcome)
  (let ((kind (outcome-kind outcome))
        (lines (outcome-log-lines outcome))
        (notes (traffic-notes (outcome-traffic outcome))))
    (format t "~&~%~A: ~,1F s; final GET /yo: ~A; server log: ~D line~:P while serving~%"
            kind (outcome-seconds outcome) (or (outcome-final-check outcome) "not run")
            (length lines))
    (let ((stats (and (outcome-end outcome) (sample-stats (outcome-end outcome)))))
      (when stats
        (format t "~&  server's own totals: ~{~(~A~) ~A~^, ~}~%"
                (loop for key in '(:accepted :closed :requests :aborted :rejected :shed :timeouts)
                      append (list key (fmt-int (getf stats key)))))))
    (loop for line in lines repeat 5
          do (format t "~&  log: ~A~%" line))
    (dolist (text notes)
      (format t "~&  client: ~A~%" text))
    (if (outcome-failures outcome)
        (dolist (text (outcome-failures outcome))
          (format t "~&  FAILED: ~A~%" text))
        (format t "~&  passed~%"))))

;;; Entry point

(defun port-free-p (port)
  "True when nothing listens on 127.0.0.1:PORT."
  (handler-case (progn (with-conn (conn port) conn) nil)
    (sb-bsd-sockets:connection-refused-error () t)))

(defun check-setup (plan)
  (dolist (program '("wrk" "timeout"))
    (unless (find-program program)
      (error "~A is missing; `make soak` installs wrk with scripts/deps.sh wrk" program)))
  (dolist (kind (plan-kinds plan))
    (unless (port-free-p (kind-port plan kind))
      (error "port ~D on 127.0.0.1 is in use (another soak running?); set SOAK_PORT"
             (kind-port plan kind)))))

(defun main (&optional (mode :full))
  "Soak every server kind in MODE (:full or :short), print the report and
exit: 0 when all passed, 1 when a check failed, 2 when the harness broke."
  (setf *start-time* (get-internal-real-time))
  (let ((plan (make-plan-for mode))
        (run-id (format nil "~A-~(~A~)" (timestamp) mode))
        (outcomes '())
        (code 2))
    (handler-case
        (progn
          (check-setup plan)
          (say "make soak~:[~;-short~]: ~:D requests per server kind (warm-up ~D%), kinds ~{~A~^, ~}; ~
                wrk -c~D keep-alive + wrk -c~D Connection: close + ~D slow + ~D aborting Lisp clients"
               (eq mode :short) (plan-requests plan) (round (* 100 (plan-warm-up-fraction plan)))
               (plan-kinds plan) (plan-keep-alive-connections plan) (plan-close-connections plan)
               (plan-slow-clients plan) (* 3 (plan-aborters-per-sort plan)))
          (dolist (kind (plan-kinds plan))
            (push (soak-kind plan run-id kind) outcomes))
          (setf outcomes (reverse outcomes))
          (print-samples plan outcomes)
          (print-traffic outcomes)
          (mapc #'print-outcome-notes outcomes)
          (let ((failed (remove-if-not #'outcome-failures outcomes)))
            (format t "~&~%Soak ~:[PASSED~;FAILED~] in ~A (~{~A~^, ~}). Server logs: ~A~%"
                    failed (clock (elapsed))
                    (mapcar (lambda (o) (format nil "~A ~:[passed~;FAILED~]"
                                                (outcome-kind o) (outcome-failures o)))
                            outcomes)
                    (enough-namestring (merge-pathnames "results/tmp/logs/" *bench-dir*) *repo*))
            (setf code (if failed 1 0))))
      (sb-sys:interactive-interrupt ()
        (format t "~&Interrupted.~%")
        (setf code 130))
      (error (e)
        (format t "~&Soak harness error: ~A~%" e)
        (setf code 2)))
    (finish-output)
    (uiop:quit code)))
