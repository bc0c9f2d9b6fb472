;;;; heads.lisp -- `make bench-heads`: partial request heads against the
;;;; head budget.
;;;;
;;;;   scripts/lisp.sh --load bench/heads.lisp --eval '(gallop-bench-heads:main)'
;;;;
;;;; Why: a client chooses how many connections it opens and how much of a
;;;; request head it sends on each before it stops, and a connection keeps
;;;; what it received (8 KiB, up to :MAX-HEAD-BYTES for a long head).  Gallop
;;;; counts those buffers against a global head budget (a quarter of SBCL's
;;;; dynamic space, see CHARGE-HEAD in src/core/http/connection.lisp); past
;;;; it a connection gets 503 instead of a bigger buffer.  This measures
;;;; that: many connections each holding a head just short of the limit must
;;;; leave the server up, its heap bounded, answering well-formed 503s,
;;;; serving a fresh GET, and giving every octet of the budget back once
;;;; they close.
;;;;
;;;; What it does, for each server kind of bench/server.lisp (`native`,
;;;; GALLOP:START, then `gallop`, GALLOP:EASY-ACCEPTOR), and each case below,
;;;; on a fresh server child process with SBCL's default heap (1 GiB):
;;;;
;;;;  1. open N (19,000) connections to 127.0.0.1 from this process (the fd
;;;;     limit is per process; the soft RLIMIT_NOFILE is raised to the hard
;;;;     one), WINDOW (128) sending at a time, and send on each a request head
;;;;     of HEAD octets without its final empty line, in 16 KiB pieces; a
;;;;     connection that the server answers (or closes) gets nothing more,
;;;;     its answer is checked octet by octet (status line and reason,
;;;;     Content-Type, Content-Length equal to the body, the body, Connection:
;;;;     close, and for 503 a numeric Retry-After; nothing after the body) and
;;;;     it is closed.  A connection that sent its whole head stays open,
;;;;     watched for a late answer.  No new connection after OPEN-SECONDS (30)
;;;;     or once BYTE-CAP (4 GiB) octets went out.  The client's sockets have
;;;;     a fixed 16 KiB send buffer (see *SEND-BUFFER*);
;;;;  2. hold: once no connection is still sending, wait until the server's
;;;;     stats hold still, read them (:IDLE = connections parked, all of them
;;;;     with a partial head; :HEAD-BYTES = the budget they hold), GET /yo on a
;;;;     fresh connection (must be exactly 200 "Hey!"), and ask for a full GC
;;;;     (heap in use after it, with everything still held);
;;;;  3. close every connection, wait until the server has no connection open
;;;;     and :HEAD-BYTES is 0 again, GET /yo again, GC again.
;;;; Meanwhile a monitor thread samples the server every 250 ms: VmRSS from
;;;; /proc/PID/status, the heap in use (garbage included), GALLOP:STATS, and
;;;; every second a GET /yo (each must be 200).  At the end VmHWM (peak RSS).
;;;;
;;;;   case      :max-head-bytes   HEAD sent     what it shows
;;;;   1mib      1 MiB (default)   1,040,000     the default limit: the 256 MiB
;;;;                                             budget holds 256 heads, the
;;;;                                             rest get 503
;;;;   64kib     65536             65,000        a lower limit: 4,096 parked
;;;;   16mib     16 MiB            16,773,216    a raised limit: 16 parked
;;;;                                             (16 at a time, see *CASES*)
;;;;   ordinary  1 MiB (default)   4,000         every connection halfway through
;;;;                                             an ordinary head: all 19,000
;;;;                                             park (19,000 x 8 KiB is within
;;;;                                             the budget)
;;;;
;;;; The servers run with BENCH_TIMEOUT=120 (header timeout 120 s instead of
;;;; 20 s), so that parked heads stay parked for the whole measurement instead
;;;; of getting 408 part of the way through it.  Everything goes to 127.0.0.1
;;;; only, each case is bounded in time (RUN-LIMIT, 180 s, server start not
;;;; included), and every fd is closed at the end of each case.
;;;;
;;;; Environment: HEADS_N (19000), HEADS_KINDS ("native,gallop"), HEADS_CASES
;;;; ("1mib,64kib,16mib,ordinary"), HEADS_PORT (18190; kind K uses PORT+K),
;;;; HEADS_WINDOW (128; when set, a sliding window of that size for every
;;;; case).  Servers log errors to
;;;; bench/results/tmp/logs/heads-KIND-CASE.log.  Exit code: 0 when every
;;;; check passed, 1 when one failed, 2 when the harness itself broke.

(load (merge-pathnames "process.lisp" (or *load-truename* *default-pathname-defaults*)))
(load (merge-pathnames "sockets.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-bench-heads
  (:use #:common-lisp #:gallop-bench-process #:gallop-bench-sockets)
  (:export #:main))
(in-package #:gallop-bench-heads)

(defparameter *bench-dir*
  (make-pathname :name nil :type nil :version nil
                 :defaults (or *load-truename* *default-pathname-defaults*)))

;;; Settings

(defparameter *cases*
  '(("1mib" nil 1040000)
    ("64kib" 65536 65000)
    ("16mib" 16777216 16773216 16 :batch)
    ("ordinary" nil 4000))
  "Each case: name, :MAX-HEAD-BYTES given to the server (NIL: Gallop's
default, 1 MiB), octets of partial head sent on each connection, and
optionally the window (connections sending at once) when not HEADS_WINDOW's,
and :BATCH to open the next window's worth only once every connection of
the last one sent its head or was answered.  16 MiB heads go 16 at a time in
batches: the budget holds exactly 16 of them, so the first 16 arrive whole
and every later connection is refused after its first octets.  With a
sliding window, new connections take a little of the budget while the 16
are growing, so the last doubling of one of them (8 to 16 MiB) fails, it is
refused after 8 MB, and so on: the client pushes gigabytes through loopback
before all 16 are in (4.3 GB for 6,000 connections with a window of 16, 4.6
GB for 8,827 with 128, before the byte cap; the server held).")

(defparameter *kinds* '("native" "gallop"))

(defparameter *run-limit* 180 "Seconds one case may take, server start not included.")
(defparameter *open-seconds* 30 "No new connection after this many seconds.")
(defparameter *byte-cap* (* 4 1024 1024 1024) "No new connection once this many octets went out.")
(defparameter *piece* 16384 "Octets sent at a time on one connection.")
(defparameter *server-timeout* 120 "The servers' header (and read, write, idle) timeout, s.")

(defparameter *send-buffer* 16384
  "SO_SNDBUF of the client's connections (the kernel doubles it).  Left to
autotuning, loopback takes up to a megabyte per connection before the
client can see the server's 503, so the 1 MiB case would push gigabytes
through loopback that the server never reads, only drains; the server does
the same either way.")

;;; The octets sent

(defun partial-head (size)
  "A request head of exactly SIZE octets without its final empty line: the
request line, Host, then X-Pad fields of at most ~1000 octets, each ending in
CRLF, so every line is valid and the head is complete but for the empty line."
  (let* ((crlf (format nil "~C~C" #\Return #\Newline))
         (start (format nil "GET /yo HTTP/1.1~AHost: 127.0.0.1~A" crlf crlf))
         (out (make-string-output-stream))
         (left (- size (length start))))
    (write-string start out)
    (loop for i from 0
          while (plusp left)
          do (let* ((name (format nil "X-Pad-~D: " i))
                    (overhead (+ (length name) 2))
                    ;; Take at most ~1000; never leave a remainder too short
                    ;; for a field line of its own.
                    (take (cond ((<= left 1000) left)
                                ((< (- left 1000) 64) (- left 64))
                                (t 1000))))
               (when (< take (+ overhead 1))
                 (error "partial-head: ~D octets cannot end in a field line" size))
               (write-string name out)
               (write-string (make-string (- take overhead) :initial-element #\a) out)
               (write-string crlf out)
               (decf left take)))
    (let ((octets (ascii (get-output-stream-string out))))
      (assert (= (length octets) size))
      octets)))

(defparameter *probe-request*
  (ascii (format nil "GET /yo HTTP/1.1~C~CHost: 127.0.0.1~C~CConnection: close~C~C~C~C"
                 #\Return #\Newline #\Return #\Newline #\Return #\Newline #\Return #\Newline)))

;;; Checking an answer, octet by octet

(defparameter *reasons*
  '((200 . "OK") (400 . "Bad Request") (408 . "Request Timeout") (414 . "URI Too Long")
    (431 . "Request Header Fields Too Large") (503 . "Service Unavailable")))

(defun find-octets (needle octets start end)
  (search needle octets :start2 start :end2 end))

(defparameter *crlfcrlf* (ascii (format nil "~C~C~C~C" #\Return #\Newline #\Return #\Newline)))
(defparameter *crlf* (ascii (format nil "~C~C" #\Return #\Newline)))

(defun token-char-p (c)
  (or (alphanumericp c) (find c "!#$%&'*+-.^_`|~")))

(defun parse-answer (octets end &key eof)
  "Check the answer in OCTETS[0, END).  Returns :INCOMPLETE, or (values
STATUS NIL) for a well-formed complete answer, or (values :MALFORMED
REASON).  With EOF true, no more octets will come."
  (declare (type octets octets))
  (let ((head-end (find-octets *crlfcrlf* octets 0 end)))
    (unless head-end
      (return-from parse-answer
        (if (or eof (>= end (length octets)))
            (values :malformed (format nil "no end of head in ~D octets" end))
            :incomplete)))
    (let* ((head (map 'string #'code-char (subseq octets 0 head-end)))
           (lines (let ((parts '()) (start 0))
                    (loop for i = (search *crlf* octets :start2 start :end2 (+ head-end 2))
                          while i
                          do (push (map 'string #'code-char (subseq octets start i)) parts)
                             (setf start (+ i 2)))
                    (nreverse parts)))
           (status-line (first lines))
           (fields '()))
      (declare (ignorable head))
      (flet ((bad (control &rest args)
               (return-from parse-answer (values :malformed (apply #'format nil control args)))))
        ;; HTTP/1.1 DDD Reason
        (unless (and (>= (length status-line) 13)
                     (string= "HTTP/1.1 " status-line :end2 9)
                     (every #'digit-char-p (subseq status-line 9 12))
                     (char= (char status-line 12) #\Space))
          (bad "status line ~S" status-line))
        (let* ((status (parse-integer status-line :start 9 :end 12))
               (reason (cdr (assoc status *reasons*))))
          (unless (and reason (string= reason (subseq status-line 13)))
            (bad "status line ~S" status-line))
          (dolist (line (rest lines))
            (let ((colon (position #\: line)))
              (unless (and colon (plusp colon)
                           (every #'token-char-p (subseq line 0 colon))
                           (< colon (1- (length line)))
                           (char= (char line (1+ colon)) #\Space)
                           (every (lambda (c) (<= 32 (char-code c) 126)) (subseq line (+ 2 colon))))
                (bad "header line ~S" line))
              (push (cons (string-downcase (subseq line 0 colon)) (subseq line (+ 2 colon)))
                    fields)))
          (flet ((one (name)
                   (let ((all (remove name fields :key #'car :test-not #'string=)))
                     (unless (= (length all) 1)
                       (bad "~D ~A fields" (length all) name))
                     (cdr (first all)))))
            (let ((length-text (one "content-length")))
              (unless (and (plusp (length length-text)) (every #'digit-char-p length-text))
                (bad "Content-Length ~S" length-text))
              (one "content-type")
              (let ((body-length (parse-integer length-text))
                    (body-start (+ head-end 4)))
                (cond ((< (- end body-start) body-length)
                       (return-from parse-answer
                         (if eof
                             (values :malformed (format nil "body ~D of ~D octets"
                                                        (- end body-start) body-length))
                             :incomplete)))
                      ((> (- end body-start) body-length)
                       (bad "~D octets after the body" (- end body-start body-length))))
                (let ((body (map 'string #'code-char (subseq octets body-start end))))
                  (if (= status 200)
                      (unless (string= body "Hey!") (bad "body ~S" body))
                      (progn
                        (unless (string-equal (one "connection") "close")
                          (bad "Connection: ~S" (one "connection")))
                        (unless (string= body (format nil "~D ~A~%" status reason))
                          (bad "body ~S" body))))))
              (when (= status 503)
                (let ((retry (one "retry-after")))
                  (unless (and (plusp (length retry)) (every #'digit-char-p retry))
                    (bad "Retry-After ~S" retry))))
              (values status nil))))))))

;;; The probe: a fresh GET /yo, bounded

(defun probe (port &key (seconds 5))
  "GET /yo on a new connection, Connection: close, read to end of file.
T when the answer is exactly 200 \"Hey!\"; else NIL and why."
  (let ((fd (open-socket (loopback-address port)))
        (deadline (+ (now-ms) (* 1000 seconds)))
        (buffer (make-array 4096 :element-type '(unsigned-byte 8)))
        (fill 0) (sent 0))
    (unless fd (return-from probe (values nil "connect failed")))
    (unwind-protect
         (loop
           (let ((left (- deadline (now-ms))))
             (when (<= left 0)
               (return (values nil (format nil "no complete answer in ~D s (~D octets)" seconds fill))))
             (let ((revents (aref (poll-fds (vector fd)
                                            (vector (if (< sent (length *probe-request*))
                                                        +pollout+ +pollin+))
                                            (min left 100))
                                  0)))
               (cond ((< sent (length *probe-request*))
                      (when (logtest revents (logior +pollout+ +pollerr+ +pollhup+))
                        (let ((n (send-some fd *probe-request* sent (length *probe-request*))))
                          (unless n (return (values nil "send failed")))
                          (incf sent n))))
                     ((logtest revents (logior +pollin+ +pollerr+ +pollhup+))
                      (when (>= fill (length buffer))
                        (return (values nil "answer over 4 KiB")))
                      (multiple-value-bind (n errno) (receive-some fd buffer fill)
                        (cond ((null n) (return (values nil (format nil "recv errno ~D" errno))))
                              ((eq n :again))
                              ((zerop n)
                               (multiple-value-bind (status why) (parse-answer buffer fill :eof t)
                                 (return (if (eql status 200)
                                             t
                                             (values nil (or why (format nil "status ~A" status)))))))
                              (t (incf fill n)))))))))
      (%close fd))))

;;; The server child (bench/server.lisp)

(defstruct (server (:conc-name server-))
  kind port process pid log (lock (sb-thread:make-mutex :name "server pipe")))

(defun server-environment (max-head-bytes)
  (environment-with (append (list "BENCH_MESSAGE_LOG=1"
                                  (format nil "BENCH_TIMEOUT=~D" *server-timeout*))
                            (and max-head-bytes
                                 (list (format nil "BENCH_MAX_HEAD_BYTES=~D" max-head-bytes))))
                    :drop '("BENCH_IDLE_TIMEOUT" "BENCH_THREAD_IDLE_TIMEOUT" "BENCH_MAX_HEAD_BYTES")))

(defun start-server (kind port max-head-bytes log)
  (multiple-value-bind (process pid)
      (start-bench-server kind port :environment (server-environment max-head-bytes)
                                    :log log :if-log-exists :supersede :timeout 120)
    (make-server :kind kind :port port :process process :log log :pid pid)))

(defun ask (server command prefix &optional (timeout 10))
  "COMMAND to SERVER's control loop; its answer line after PREFIX, or NIL.
Serialized: the monitor thread and the main thread share the pipe."
  (sb-thread:with-mutex ((server-lock server))
    (ask-process (server-process server) command prefix timeout)))

(defun server-stats (server)
  (sb-thread:with-mutex ((server-lock server))
    (ask-stats (server-process server))))

(defun server-heap (server)
  "The server's heap in use now (garbage included) and its dynamic space size."
  (let ((text (ask server "heap" "HEAP ")))
    (when text
      (let ((parts (uiop:split-string text)))
        (values (parse-integer (first parts)) (parse-integer (second parts)))))))

(defun server-gc (server)
  "A full GC in SERVER; its heap in use after it."
  (sb-thread:with-mutex ((server-lock server))
    (ask-gc (server-process server))))

(defun stop-server (server)
  (let ((process (server-process server)))
    (ignore-errors
     (sb-thread:with-mutex ((server-lock server) :timeout 10)
       (let ((in (sb-ext:process-input process)))
         (write-line "quit" in)
         (finish-output in)
         (close in))))
    (wait-exit process 5)
    (kill-and-reap process)))

;;; The monitor thread

(defstruct (watch (:conc-name watch-))
  (stop nil)
  (rss-max 0) (heap-max 0) (idle-max 0) (head-bytes-max 0) (open-max 0)
  (probes 0) (probes-ok 0) (probe-failure nil) (samples 0))

(defun monitor (server watch)
  "Sample SERVER every 250 ms into WATCH, and probe it every second, until
WATCH-STOP."
  (loop with next-probe = (+ (now-ms) 1000)
        until (watch-stop watch)
        do (let ((rss (proc-field (server-pid server) "VmRSS"))
                 (heap (server-heap server))
                 (stats (server-stats server)))
             (incf (watch-samples watch))
             (when rss (setf (watch-rss-max watch) (max rss (watch-rss-max watch))))
             (when heap (setf (watch-heap-max watch) (max heap (watch-heap-max watch))))
             (when stats
               (setf (watch-idle-max watch) (max (getf stats :idle 0) (watch-idle-max watch))
                     (watch-open-max watch) (max (getf stats :open 0) (watch-open-max watch))
                     (watch-head-bytes-max watch)
                     (max (getf stats :head-bytes 0) (watch-head-bytes-max watch))))
             (when (>= (now-ms) next-probe)
               (setf next-probe (+ (now-ms) 1000))
               (incf (watch-probes watch))
               (multiple-value-bind (ok why) (probe (server-port server))
                 (if ok
                     (incf (watch-probes-ok watch))
                     (unless (watch-probe-failure watch)
                       (setf (watch-probe-failure watch) why)))))
             (sleep 0.25))))

;;; The client

(defstruct (conn (:conc-name conn-))
  fd
  (state :connecting)          ; :connecting :sending :sent, then :done
  (sent 0 :type fixnum)
  (buffer nil)                 ; octets received, once any arrive
  (fill 0 :type fixnum))

(defstruct (tally (:conc-name tally-))
  (opened 0) (open-failed 0) (open-errno nil) (bytes 0)
  (answers (make-hash-table))   ; status -> count (well-formed answers)
  (malformed 0) (malformed-example nil)
  (closed-unanswered 0)         ; end of file, no octet of an answer
  (connect-failed 0)            ; the connection itself failed (SO_ERROR)
  (reset 0) (reset-errno nil)   ; send or recv failed before a whole answer
  (answered-after-sent 0)       ; answers that came after the whole head was sent
  (sent-all 0))

(defun finish-conn (c)
  (%close (conn-fd c))
  (setf (conn-state c) :done (conn-fd c) -1 (conn-buffer c) nil))

(defun note-answer (c tally status why)
  (cond (why
         (incf (tally-malformed tally))
         (unless (tally-malformed-example tally)
           (setf (tally-malformed-example tally) why)))
        (t (incf (gethash status (tally-answers tally) 0))))
  (when (eq (conn-state c) :sent)
    (incf (tally-answered-after-sent tally)))
  (finish-conn c))

(defun read-answer (c tally)
  "Read what the server sent on C; once it is a whole answer (or the
connection ended), count it and close C."
  (unless (conn-buffer c)
    (setf (conn-buffer c) (make-array 2048 :element-type '(unsigned-byte 8))))
  (loop
    (let ((buffer (conn-buffer c)))
      (when (>= (conn-fill c) (length buffer))
        (return (note-answer c tally :malformed "answer over 2 KiB")))
      (multiple-value-bind (n errno) (receive-some (conn-fd c) buffer (conn-fill c))
        (cond ((eq n :again)
               (when (plusp (conn-fill c))
                 (multiple-value-bind (status why) (parse-answer buffer (conn-fill c))
                   (unless (eq status :incomplete)
                     (note-answer c tally status why))))
               (return))
              ((null n)
               (multiple-value-bind (status why) (parse-answer buffer (conn-fill c) :eof t)
                 (if (and (plusp (conn-fill c)) (not (eq status :malformed)))
                     (note-answer c tally status why)
                     (progn (incf (tally-reset tally))
                            (setf (tally-reset-errno tally) errno)
                            (finish-conn c))))
               (return))
              ((zerop n)
               (if (zerop (conn-fill c))
                   (progn (incf (tally-closed-unanswered tally)) (finish-conn c))
                   (multiple-value-bind (status why) (parse-answer buffer (conn-fill c) :eof t)
                     (note-answer c tally status why)))
               (return))
              (t (incf (conn-fill c) n)))))))

(defun send-more (c head tally)
  "Send the next piece of HEAD on C."
  (let ((end (min (length head) (+ (conn-sent c) *piece*))))
    (multiple-value-bind (n errno) (send-some (conn-fd c) head (conn-sent c) end)
      (cond ((null n)
             ;; The server closed: its answer, if any, is readable.
             (setf (tally-reset-errno tally) errno)
             (read-answer c tally)
             (unless (eq (conn-state c) :done)
               (incf (tally-reset tally))
               (finish-conn c)))
            (t (incf (conn-sent c) n)
               (incf (tally-bytes tally) n)
               (when (= (conn-sent c) (length head))
                 (incf (tally-sent-all tally))
                 (setf (conn-state c) :sent)))))))

(defun run-client (port n head window deadline tally &key batch)
  "Open N connections to PORT, WINDOW at a time (with BATCH, the next WINDOW
only once none of the last is sending), sending HEAD on each (see the file's
header).  Returns the connections still open (all sent, no answer) and the
milliseconds it took."
  (let* ((address (loopback-address port))
         (start (now-ms))
         (open-until (+ start (* 1000 *open-seconds*)))
         (active '())
         (held '())
         (next-held-check 0)
         (opening t))
    (loop
      ;; Fill the window (in batches: only once it is empty).
      (loop repeat (if (and batch active) 0 (- window (length active)))
            while opening
            do (cond ((or (>= (tally-opened tally) n) (>= (now-ms) open-until)
                          (>= (tally-bytes tally) *byte-cap*))
                      (setf opening nil))
                     (t (multiple-value-bind (fd errno)
                            (open-socket address :send-buffer *send-buffer*)
                          (cond (fd (incf (tally-opened tally))
                                    (push (make-conn :fd fd) active))
                                (t (incf (tally-open-failed tally))
                                   (setf (tally-open-errno tally) errno)
                                   ;; Out of fds, or the server is gone: stop opening.
                                   (when (> (tally-open-failed tally) 100)
                                     (setf opening nil))))))))
      (when (or (and (not opening) (null active)) (>= (now-ms) deadline))
        (return))
      ;; Serve the window.
      (let* ((v (coerce active 'vector))
             (revents (poll-fds (map 'vector #'conn-fd v)
                                (map 'vector (lambda (c) (logior +pollin+ +pollout+)) v)
                                20)))
        (loop for c across v
              for r across revents
              do (when (plusp r)
                   (case (conn-state c)
                     (:connecting
                      (let ((err (socket-error (conn-fd c))))
                        (if (zerop err)
                            (setf (conn-state c) :sending)
                            (progn (incf (tally-connect-failed tally))
                                   (setf (tally-open-errno tally) err)
                                   (finish-conn c)))))
                     (:sending
                      (cond ((logtest r (logior +pollin+ +pollerr+ +pollhup+))
                             (read-answer c tally))
                            ;; Nothing more once part of an answer came.
                            ((and (logtest r +pollout+) (zerop (conn-fill c)))
                             (send-more c head tally)))))))
        (setf active (loop for c in active
                           if (eq (conn-state c) :sent) do (push c held)
                           else unless (eq (conn-state c) :done) collect c)))
      ;; A late answer on a held connection: the server refused to park it
      ;; after its last read (the budget), or gave up on it.
      (when (>= (now-ms) next-held-check)
        (setf next-held-check (+ (now-ms) 250))
        (setf held (check-held held tally))))
    (values (check-held (append active held) tally) (- (now-ms) start))))

(defun check-held (conns tally)
  "Read answers that arrived on CONNS; those still open."
  (when conns
    (let* ((v (coerce conns 'vector))
           (revents (poll-fds (map 'vector #'conn-fd v)
                              (make-array (length v) :initial-element +pollin+)
                              0)))
      (loop for c across v
            for r across revents
            do (when (logtest r (logior +pollin+ +pollerr+ +pollhup+))
                 (read-answer c tally)))
      (remove :done conns :key #'conn-state))))

(defun close-all (conns)
  (dolist (c conns)
    (when (>= (conn-fd c) 0)
      (%close (conn-fd c))
      (setf (conn-fd c) -1 (conn-state c) :done))))

;;; One case

(defun wait-stats (server predicate seconds)
  "Poll SERVER's stats every 100 ms until PREDICATE holds for them or
SECONDS pass; the last stats and the milliseconds waited."
  (let ((start (now-ms)) (stats nil))
    (loop
      (setf stats (server-stats server))
      (when (or (and stats (funcall predicate stats))
                (> (- (now-ms) start) (* 1000 seconds)))
        (return (values stats (- (now-ms) start))))
      (sleep 0.1))))

(defun mib (octets) (if octets (/ octets 1048576.0) 0.0))

(defun run-case (kind port case n window)
  "Run CASE against a fresh KIND server; a property list of results."
  (destructuring-bind (name max-head-bytes head-size &optional case-window batch) case
    ;; HEADS_WINDOW sets a sliding window of that size for every case.
    (if (env "HEADS_WINDOW")
        (setf batch nil)
        (when case-window (setf window case-window)))
    (let* ((log (ensure-directories-exist
                 (merge-pathnames (format nil "bench/results/tmp/logs/heads-~A-~A.log" kind name)
                                  *repo*)))
           (server (start-server kind port max-head-bytes log))
           (watch (make-watch))
           (tally (make-tally))
           (head (partial-head head-size))
           (held '())
           (result (list :kind kind :case name :n n :head head-size :window window :batch batch
                         :max-head-bytes (or max-head-bytes 1048576)))
           (monitor nil))
      (format t "~&~A ~A: server pid ~D on port ~D, heads of ~:D octets~@[ (:max-head-bytes ~:D)~], ~
                 window ~D~%"
              kind name (server-pid server) port head-size max-head-bytes window)
      (finish-output)
      (unwind-protect
           (let ((deadline (+ (now-ms) (* 1000 *run-limit*))))
             (setf (getf result :gc-before) (server-gc server)
                   (getf result :rss-before) (proc-field (server-pid server) "VmRSS"))
             (multiple-value-bind (heap size) (server-heap server)
               (declare (ignore heap))
               (setf (getf result :dynamic-space) size
                     (getf result :budget) (and size (floor size 4))))
             (setf monitor (sb-thread:make-thread #'monitor :name "heads monitor"
                                                            :arguments (list server watch)))
             ;; 1. open and send
             (multiple-value-bind (open ms)
                 (run-client port n head window (- deadline (* 1000 60)) tally :batch batch)
               (setf held open
                     (getf result :client-ms) ms))
             ;; 2. hold: until the server's stats hold still (up to 10 s)
             (let ((last nil) (stable 0) (start (now-ms)))
               (loop while (and (< stable 3) (< (- (now-ms) start) 10000))
                     do (sleep 0.5)
                        (setf held (check-held held tally))
                        (let ((stats (server-stats server)))
                          (if (and stats last
                                   (eql (getf stats :idle) (getf last :idle))
                                   (eql (getf stats :head-bytes) (getf last :head-bytes)))
                              (incf stable)
                              (setf stable 0))
                          (setf last stats)))
               (setf (getf result :held-stats) last))
             (setf held (check-held held tally))
             (setf (getf result :held) (length held))
             (setf (getf result :probe-held) (multiple-value-list (probe port)))
             (setf (getf result :gc-held) (server-gc server))
             (setf (getf result :rss-held) (proc-field (server-pid server) "VmRSS"))
             ;; 3. close everything; the budget must come back
             (setf held (check-held held tally))
             (let ((start (now-ms)))
               (close-all held)
               (let ((stats (wait-stats server (lambda (s) (and (eql (getf s :head-bytes) 0)
                                                                (eql (getf s :open) 0)))
                                        (max 1 (min 30 (floor (- deadline (now-ms)) 1000))))))
                 (setf (getf result :after-stats) stats
                       (getf result :release-ms) (- (now-ms) start))))
             (setf (getf result :probe-after) (multiple-value-list (probe port)))
             (setf (getf result :gc-after) (server-gc server)))
        (setf (watch-stop watch) t)
        (when monitor (sb-thread:join-thread monitor :default nil))
        (close-all held)
        (setf (getf result :hwm) (proc-field (server-pid server) "VmHWM")
              (getf result :alive) (and (alive-p (server-process server)) t))
        (stop-server server))
      (setf (getf result :tally) tally
            (getf result :watch) watch)
      result)))

;;; Report

(defun answers-string (tally)
  (let ((pairs '()))
    (maphash (lambda (k v) (push (cons k v) pairs)) (tally-answers tally))
    (format nil "~:[none~;~:*~{~A~^, ~}~]"
            (mapcar (lambda (p) (format nil "~D x ~:D" (car p) (cdr p)))
                    (sort pairs #'< :key #'car)))))

(defun check-case (r)
  "The failed checks of result R, as strings."
  (let ((tally (getf r :tally))
        (watch (getf r :watch))
        (after (getf r :after-stats))
        (failures '()))
    (flet ((fail (control &rest args) (push (apply #'format nil control args) failures)))
      (unless (getf r :alive) (fail "the server died"))
      (unless (first (getf r :probe-held)) (fail "GET /yo while held: ~A" (second (getf r :probe-held))))
      (unless (first (getf r :probe-after)) (fail "GET /yo after: ~A" (second (getf r :probe-after))))
      (unless (= (watch-probes watch) (watch-probes-ok watch))
        (fail "~D of ~D periodic GET /yo failed (first: ~A)"
              (- (watch-probes watch) (watch-probes-ok watch)) (watch-probes watch)
              (watch-probe-failure watch)))
      (unless (and after (eql (getf after :head-bytes) 0))
        (fail "head-bytes after closing: ~A" (and after (getf after :head-bytes))))
      (unless (and after (eql (getf after :open) 0))
        (fail "connections open after closing: ~A" (and after (getf after :open))))
      (when (plusp (tally-malformed tally))
        (fail "~D malformed answers (first: ~A)" (tally-malformed tally)
              (tally-malformed-example tally)))
      (let ((other (loop for k being the hash-keys of (tally-answers tally) using (hash-value v)
                         unless (member k '(503 431)) sum v)))
        (when (plusp other) (fail "~D answers other than 503/431: ~A" other (answers-string tally))))
      (when (plusp (tally-reset tally))
        (fail "~D connections reset without a whole answer (errno ~A)"
              (tally-reset tally) (tally-reset-errno tally)))
      (when (plusp (tally-closed-unanswered tally))
        (fail "~D connections closed without an answer" (tally-closed-unanswered tally)))
      (when (plusp (tally-connect-failed tally))
        (fail "~D connections failed to connect (errno ~A)" (tally-connect-failed tally)
              (tally-open-errno tally)))
      (let ((accounted (+ (getf r :held)
                          (loop for v being the hash-values of (tally-answers tally) sum v)
                          (tally-malformed tally) (tally-reset tally)
                          (tally-closed-unanswered tally) (tally-connect-failed tally))))
        (unless (= accounted (tally-opened tally))
          (fail "~D connections opened, ~D parked or answered" (tally-opened tally) accounted))))
    (nreverse failures)))

(defun print-case (r)
  (let ((tally (getf r :tally))
        (watch (getf r :watch))
        (held (getf r :held-stats)))
    (format t "~&  opened ~:D (~:D failed~@[, errno ~D~]) in ~,1F s, ~,1F MB sent; ~
               ~:D sent their whole head~%"
            (tally-opened tally) (tally-open-failed tally) (tally-open-errno tally)
            (/ (getf r :client-ms) 1000.0) (/ (tally-bytes tally) 1e6) (tally-sent-all tally))
    (format t "  answers: ~A (~:D of them after the whole head was sent); malformed ~:D; ~
               reset ~:D; closed unanswered ~:D~%"
            (answers-string tally) (tally-answered-after-sent tally) (tally-malformed tally)
            (tally-reset tally) (tally-closed-unanswered tally))
    (format t "  held: ~:D connections open client-side; server open=~A idle=~A head-bytes=~:D ~
               (~,1F MiB of a ~,1F MiB budget) accepted=~A closed=~A requests=~A shed=~A ~
               rejected=~A timeouts=~A threads=~A~%"
            (getf r :held) (getf held :open) (getf held :idle) (getf held :head-bytes 0)
            (mib (getf held :head-bytes)) (mib (getf r :budget))
            (getf held :accepted) (getf held :closed) (getf held :requests)
            (getf held :shed) (getf held :rejected) (getf held :timeouts) (getf held :threads))
    (format t "  peaks: idle ~:D, head-bytes ~,1F MiB, RSS ~,1F MiB (VmHWM ~,1F MiB; ~,1F MiB ~
               before), heap in use ~,1F MiB of ~,1F MiB~%"
            (watch-idle-max watch) (mib (watch-head-bytes-max watch))
            (/ (watch-rss-max watch) 1024.0) (/ (or (getf r :hwm) 0) 1024.0)
            (/ (or (getf r :rss-before) 0) 1024.0)
            (mib (watch-heap-max watch)) (mib (getf r :dynamic-space)))
    (format t "  heap after a full GC: ~,1F MiB before, ~,1F MiB held, ~,1F MiB after closing~%"
            (mib (getf r :gc-before)) (mib (getf r :gc-held)) (mib (getf r :gc-after)))
    (format t "  closing all: server back to open=~A head-bytes=~A in ~:D ms; ~
               GET /yo 200 held: ~A, after: ~A, every second: ~D of ~D~%"
            (getf (getf r :after-stats) :open) (getf (getf r :after-stats) :head-bytes)
            (getf r :release-ms)
            (if (first (getf r :probe-held)) "yes" (second (getf r :probe-held)))
            (if (first (getf r :probe-after)) "yes" (second (getf r :probe-after)))
            (watch-probes-ok watch) (watch-probes watch))
    (let ((failures (check-case r)))
      (format t "  ~:[PASS~;FAIL~]~{~%    - ~A~}~%" failures failures))
    (finish-output)))

(defun kind-label (kind)
  (if (string= kind "native") "gallop:start (native)" "gallop:easy-acceptor"))

(defun print-table (results)
  "The results as a markdown table (for BENCHMARKS.md)."
  (format t "~%| server | limit | head sent | window | opened | parked | budget held | 503 | other | peak heap in use | heap after GC, held | peak RSS | client | budget back |~%")
  (format t "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|~%")
  (dolist (r results)
    (let* ((tally (getf r :tally))
           (held (getf r :held-stats))
           (watch (getf r :watch))
           (limit (getf r :max-head-bytes))
           (answered (loop for v being the hash-values of (tally-answers tally) sum v))
           (shed (gethash 503 (tally-answers tally) 0)))
      (format t "| ~A | ~A | ~:D | ~D | ~:D | ~:D | ~,1F MiB | ~:D | ~:D | ~:D MiB | ~:D MiB | ~:D MiB | ~,1F s | ~:[no~;~:*~:D ms~] |~%"
              (kind-label (getf r :kind))
              (if (zerop (mod limit 1048576))
                  (format nil "~D MiB" (floor limit 1048576))
                  (format nil "~:D" limit))
              (getf r :head) (getf r :window) (tally-opened tally)
              (or (getf held :idle) 0) (mib (getf held :head-bytes))
              shed (- answered shed)
              (round (watch-heap-max watch) 1048576)
              (round (or (getf r :gc-held) 0) 1048576)
              (round (or (getf r :hwm) 0) 1024)
              (/ (getf r :client-ms) 1000.0)
              (and (getf r :after-stats) (eql (getf (getf r :after-stats) :head-bytes) 0)
                   (getf r :release-ms)))))
  (finish-output))

(defun main ()
  (let ((code 0))
    (handler-case
        (let* ((n (env-int "HEADS_N" 19000))
               (window (env-int "HEADS_WINDOW" 128))
               (base (env-int "HEADS_PORT" 18190))
               (kinds (env-choices "HEADS_KINDS" "kind" *kinds* *kinds*))
               (cases (loop for name in (env-list "HEADS_CASES" (mapcar #'first *cases*))
                            collect (or (assoc name *cases* :test #'string=)
                                        (error "HEADS_CASES: unknown case ~S" name))))
               (limit (raise-fd-limit))
               (results '()))
          (when (< limit (+ n 64))
            (error "fd limit ~D is too low for ~D connections" limit n))
          (let ((wrk (string-trim '(#\Newline #\Space)
                                  (uiop:run-program '("pgrep" "-x" "wrk")
                                                    :ignore-error-status t :output :string))))
            (when (plusp (length wrk))
              (format t "~&note: wrk is running (pid ~A): a load test shares the machine~%"
                      (substitute #\Space #\Newline wrk))))
          (format t "~&Partial heads against the head budget: ~:D connections, window ~D, ~
                     SBCL ~A~%" n window (lisp-implementation-version))
          (loop for kind in kinds
                for k from 0
                do (dolist (case cases)
                     (let ((r (run-case kind (+ base k) case n window)))
                       (print-case r)
                       (push r results)
                       (when (check-case r) (setf code 1)))))
          (print-table (reverse results)))
      (error (e)
        (format *error-output* "~&bench-heads: ~A~%" e)
        (setf code 2)))
    (finish-output)
    (sb-ext:exit :code code :abort t)))
