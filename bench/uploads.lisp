;;;; uploads.lisp -- `make bench-uploads`: the server's memory while clients
;;;; upload large request bodies.
;;;;
;;;;   scripts/lisp.sh --load bench/uploads.lisp --eval '(gallop-bench-uploads:main)'
;;;;
;;;; Why: Gallop reads a request body before its handler runs, in epoll,
;;;; keeping at most :BODY-BUFFER-BYTES of it in memory and the rest in a
;;;; temporary file (src/core/http/spool.lisp), whatever the client's framing.
;;;; This measures that claim from outside: the resident memory of a server
;;;; process while many clients upload large bodies at once.
;;;;
;;;; For each server kind (bench/server.lisp's `native`, GALLOP:START, and
;;;; `gallop`, GALLOP:EASY-ACCEPTOR; and `stock` Hunchentoot for comparison),
;;;; each in its own SBCL child process on 127.0.0.1, and for each row of
;;;;   framing: Content-Length | chunked, 64 KiB chunks | chunked, the whole
;;;;            body in one chunk (a client chooses its chunk sizes)
;;;;   path:    /upload (reads the body in 64 KiB pieces, answers the count)
;;;;          | /ignore (never reads it, answers "ignored")
;;;; it runs CLIENTS (8) clients at once, each sending one request with a
;;;; body of BODY (50 MiB) pseudo-random octets (every octet value, CR and LF
;;;; among them), and measures:
;;;;  - before: the server's VmRSS (/proc/PID/status) after a full GC (the
;;;;    "gc" command of bench/server.lisp) and 0.3 s of quiet;
;;;;  - peak: the largest VmRSS sampled every 50 ms while the clients run, or
;;;;    the kernel's VmHWM if larger (reset to the current VmRSS through
;;;;    /proc/PID/clear_refs just before the clients start, so it is the exact
;;;;    peak of the row, also between two samples);
;;;;  - rise = peak - before; the goal is at most 32 MiB in every row;
;;;;  - answers correct: each client reads its answer strictly, byte by byte:
;;;;    every line ends in CRLF, the status line is exactly
;;;;    "HTTP/1.1 200 OK", header lines are "name: value" with a token name,
;;;;    exactly one Content-Length and no Transfer-Encoding, the body is
;;;;    exactly Content-Length octets and is the decimal count of the octets
;;;;    sent (/upload) or "ignored" (/ignore), and nothing follows it.
;;;; The clients are Lisp threads with their own sockets in this process (not
;;;; the server's).  Between two 64 KiB writes a client looks for an answer;
;;;; once one arrived (/ignore: once the server read the body) it stops
;;;; sending and reads it.  A write that fails because the server closed is
;;;; noted, and the answer still read.
;;;;
;;;; Each server first serves a warm-up (every row once with 2 MiB bodies, not
;;;; measured), so that its worker threads exist before the first sample.
;;;; Every row is bounded in time (UPLOADS_TIME_LIMIT, 120 s; 30 s for stock,
;;;; which reads a chunked body it ignores into memory 8 KiB at a time with
;;;; ADJUST-ARRAY, copying all of it each time); past it the server is
;;;; killed (which ends the clients' writes and reads), the row reported as
;;;; timed out and the server started again for the next row.  A server that
;;;; died is reported and started again too.  Servers log errors to
;;;; bench/results/tmp/logs/uploads-KIND.log.
;;;;
;;;; Environment: UPLOADS_KINDS (default "native,gallop,stock"),
;;;; UPLOADS_CLIENTS (8), UPLOADS_MB (50, MiB per body), UPLOADS_TIME_LIMIT
;;;; (120), UPLOADS_PORT (18280; kind N uses PORT+N).
;;;;
;;;; Exit code: 0 when every row of Gallop's kinds met the goal with every
;;;; answer correct (stock rows are reported, not judged), 1 otherwise, 2 when
;;;; the harness itself broke.

(require :sb-bsd-sockets)

(load (merge-pathnames "process.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-bench-uploads
  (:use #:common-lisp #:gallop-bench-process)
  (:export #:main))
(in-package #:gallop-bench-uploads)

(defparameter *bench-dir*
  (make-pathname :name nil :type nil :version nil
                 :defaults (or *load-truename* *default-pathname-defaults*)))

(deftype octets () '(simple-array (unsigned-byte 8) (*)))

;;; Settings

(defparameter *kinds* '("native" "gallop" "stock")
  "The server kinds measured, by bench/server.lisp's names.")

(defparameter *judged-kinds* '("native" "gallop")
  "The kinds whose rows decide the exit code: Gallop's.")

(defparameter *goal-bytes* (* 32 1024 1024)
  "The most a row may raise the server's resident memory.")

(defparameter *piece-bytes* 65536
  "The size of the clients' writes, and of their chunks in the 64 KiB rows.")

(defparameter *warm-up-bytes* (* 2 1024 1024)
  "The body size of the warm-up's requests.")

(defparameter *io-timeout* 60
  "Seconds a client's single read or write may wait.")

(defparameter *framings* '(:length :chunked :one-chunk))
(defparameter *paths* '("/upload" "/ignore"))

(defstruct (plan (:conc-name plan-))
  kinds clients body-bytes time-limit port)

(defun make-plan-from-environment ()
  (let ((kinds (let ((v (env "UPLOADS_KINDS")))
                 (if v
                     (remove "" (mapcar (lambda (s) (string-trim " " s))
                                        (uiop:split-string v :separator ","))
                             :test #'string=)
                     *kinds*))))
    (dolist (kind kinds)
      (unless (member kind *kinds* :test #'string=)
        (error "UPLOADS_KINDS: unknown kind ~S (known: ~{~A~^, ~})" kind *kinds*)))
    (make-plan :kinds kinds
               :clients (max 1 (env-int "UPLOADS_CLIENTS" 8))
               :body-bytes (* 1024 1024 (max 1 (env-int "UPLOADS_MB" 50)))
               :time-limit (max 5 (env-int "UPLOADS_TIME_LIMIT" 120))
               :port (env-int "UPLOADS_PORT" 18280))))

(defun kind-time-limit (plan kind)
  (if (string= kind "stock") (min 30 (plan-time-limit plan)) (plan-time-limit plan)))

;;; Output

(defun say (control &rest args)
  "A progress line, prefixed with the seconds since the start."
  (format t "~&[~5,1F s] ~?~%"
          (/ (- (get-internal-real-time) *start-time*) internal-time-units-per-second)
          control args)
  (finish-output))

(defun mib (bytes) (/ bytes 1048576.0))

(defun framing-name (framing body-bytes)
  (ecase framing
    (:length "Content-Length")
    (:chunked "chunked, 64 KiB chunks")
    (:one-chunk (format nil "chunked, one ~D MiB chunk" (round body-bytes 1048576)))))

;;; The payload: pseudo-random octets, made once.

(defun make-payload (bytes)
  "BYTES octets of a fixed pseudo-random sequence (xorshift32): every octet
value occurs, CR and LF among them: nothing in the body may be taken for
framing."
  (let ((payload (make-array bytes :element-type '(unsigned-byte 8)))
        (x 2463534242))
    (declare (type (unsigned-byte 32) x) (type octets payload))
    (dotimes (i bytes payload)
      (setf x (logand #xffffffff (logxor x (ash x 13)))
            x (logxor x (ash x -17))
            x (logand #xffffffff (logxor x (ash x 5))))
      (setf (aref payload i) (logand x #xff)))))

(defun request-segments (path framing payload bytes)
  "The request as a list of (vector start end): the head, then the first
BYTES octets of PAYLOAD framed as FRAMING, in writes of at most
*PIECE-BYTES* data octets."
  (let ((segments '()))
    (flet ((add (vector &optional (start 0) (end (length vector)))
             (push (list vector start end) segments))
           (data-pieces (from to)
             (loop for start from from below to by *piece-bytes*
                   collect (list payload start (min to (+ start *piece-bytes*))))))
      (add (ascii (format nil "POST ~A HTTP/1.1~C~CHost: 127.0.0.1~C~C~
                               Content-Type: application/octet-stream~C~C~A~C~C~C~C"
                          path #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
                          (if (eq framing :length)
                              (format nil "Content-Length: ~D" bytes)
                              "Transfer-Encoding: chunked")
                          #\Return #\Linefeed #\Return #\Linefeed)))
      (let ((crlf (ascii (coerce '(#\Return #\Linefeed) 'string))))
        (ecase framing
          (:length
           (dolist (piece (data-pieces 0 bytes)) (push piece segments)))
          (:chunked
           (dolist (piece (data-pieces 0 bytes))
             (add (ascii (format nil "~X~C~C" (- (third piece) (second piece))
                                 #\Return #\Linefeed)))
             (push piece segments)
             (add crlf)))
          (:one-chunk
           (add (ascii (format nil "~X~C~C" bytes #\Return #\Linefeed)))
           (dolist (piece (data-pieces 0 bytes)) (push piece segments))
           (add crlf)))
        (unless (eq framing :length)
          (add (ascii (format nil "0~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed))))))
    (nreverse segments)))

;;; A strict reader of one response.

(define-condition wire-error (error)
  ((text :initarg :text :reader wire-error-text))
  (:report (lambda (c s) (write-string (wire-error-text c) s))))

(defun wire-error (control &rest args)
  (error 'wire-error :text (apply #'format nil control args)))

(defun read-wire-line (stream what)
  "One line ending in CRLF, without it; a WIRE-ERROR at end of file, on a
bare CR or LF, or past 8 KiB."
  (let ((line (make-array 64 :element-type 'character :adjustable t :fill-pointer 0)))
    (loop
      (let ((b (read-byte stream nil nil)))
        (cond ((null b) (wire-error "end of file in the ~A after ~S" what (coerce line 'string)))
              ((= b 13) (if (eql (read-byte stream nil nil) 10)
                            (return (coerce line 'string))
                            (wire-error "a bare CR in the ~A" what)))
              ((= b 10) (wire-error "a bare LF in the ~A" what))
              ((>= (length line) 8192) (wire-error "the ~A is over 8 KiB" what))
              (t (vector-push-extend (code-char b) line)))))))

(defun token-char-p (c)
  (or (alphanumericp c) (find c "!#$%&'*+-.^_`|~")))

(defun read-strict-response (stream expected-body)
  "Read one response from STREAM and check it as the header of this file
says; a WIRE-ERROR when it is wrong."
  (let ((status (read-wire-line stream "status line")))
    (unless (string= status "HTTP/1.1 200 OK")
      (wire-error "status line ~S" status))
    (let ((lengths '()))
      (loop for line = (read-wire-line stream "header section")
            until (zerop (length line))
            do (let ((colon (position #\: line)))
                 (unless (and colon (plusp colon) (every #'token-char-p (subseq line 0 colon)))
                   (wire-error "malformed header line ~S" line))
                 (let ((name (subseq line 0 colon))
                       (value (string-trim '(#\Space #\Tab) (subseq line (1+ colon)))))
                   (when (find-if (lambda (c) (or (< (char-code c) 32) (= (char-code c) 127)))
                                  (remove #\Tab value))
                     (wire-error "control character in header line ~S" line))
                   (cond ((string-equal name "Content-Length") (push value lengths))
                         ((string-equal name "Transfer-Encoding")
                          (wire-error "Transfer-Encoding in the answer: ~S" value))))))
      (unless (and (= 1 (length lengths))
                   (plusp (length (first lengths)))
                   (every #'digit-char-p (first lengths)))
        (wire-error "Content-Length fields ~S" lengths))
      (let* ((length (parse-integer (first lengths)))
             (body (make-array length :element-type '(unsigned-byte 8)))
             (got (read-sequence body stream)))
        (unless (= got length)
          (wire-error "the body ends after ~D of ~D octets" got length))
        (let ((text (map 'string #'code-char body)))
          (unless (string= text expected-body)
            (wire-error "body ~S, expected ~S" text expected-body)))
        ;; Nothing may follow the answer (end of file or a reset is fine).
        (let ((extra (handler-case (and (listen stream) (read-byte stream nil nil))
                       (error () nil))))
          (when extra
            (wire-error "octets after the answer (first ~D)" extra)))
        t))))

;;; One client

(defstruct (outcome (:conc-name outcome-))
  ok message (sent 0) early write-error)

(defun upload (port segments expected-body)
  "Send the request SEGMENTS on a new connection to 127.0.0.1:PORT, stop
early once an answer arrives, and read and check the answer.  An OUTCOME."
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
        (outcome (make-outcome))
        (stream nil))
    (unwind-protect
         (handler-case
             (progn
               (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
               (setf stream (sb-bsd-sockets:socket-make-stream
                             socket :input t :output t :element-type '(unsigned-byte 8)
                                    :buffering :full :timeout *io-timeout*))
               (handler-case
                   (loop for (vector start end) in segments
                         do (when (listen stream)
                              (setf (outcome-early outcome) t)
                              (return))
                            (write-sequence vector stream :start start :end end)
                            (finish-output stream)
                            (incf (outcome-sent outcome) (- end start)))
                 (stream-error (e)
                   (setf (outcome-write-error outcome) (princ-to-string e))))
               (read-strict-response stream expected-body)
               (setf (outcome-ok outcome) t))
           (error (e)
             (setf (outcome-message outcome)
                   (format nil "~A~@[ (after a failed write: ~A)~]"
                           e (outcome-write-error outcome)))))
      (when stream (ignore-errors (close stream :abort t)))
      (ignore-errors (sb-bsd-sockets:socket-close socket)))
    outcome))

;;; Child processes

(defstruct (server (:conc-name server-))
  kind port process pid)

(defun log-path (kind)
  (merge-pathnames (format nil "results/tmp/logs/uploads-~A.log" kind) *bench-dir*))

(defun start-server (kind port)
  "Start bench/server.lisp as KIND on PORT and wait for READY."
  (let ((log (log-path kind)))
    (ensure-directories-exist log)
    (multiple-value-bind (process pid)
        (start-bench-server kind port
                            :environment (environment-with '("BENCH_MESSAGE_LOG=1")
                                                           :drop-prefix "BENCH_")
                            :log log)
      (make-server :kind kind :port port :process process :pid pid))))

(defun server-command (server command)
  "Send COMMAND to SERVER; its answer line, or NIL."
  (handler-case
      (let ((process (server-process server)))
        (write-line command (sb-ext:process-input process))
        (finish-output (sb-ext:process-input process))
        (read-line-timeout (sb-ext:process-output process) 30))
    (error () nil)))

(defun stop-server (server)
  (when server
    (ignore-errors (server-command server "quit"))
    (unless (wait-exit (server-process server) 3)
      (kill-and-reap (server-process server)))
    (ignore-errors (sb-ext:process-close (server-process server)))))

(defun status-bytes (pid field)
  "The FIELD (\"VmRSS\", \"VmHWM\") of /proc/PID/status in bytes, or NIL
when the process is gone."
  (let ((kib (ignore-errors (proc-field pid field))))
    (and kib (* 1024 kib))))

(defun rss-bytes (pid) (status-bytes pid "VmRSS"))

(defun reset-high-water-mark (pid)
  "Set VmHWM of process PID to its current VmRSS (proc(5), clear_refs 5), so
that VmHWM afterwards is the exact peak since now; true if that worked."
  (ignore-errors
   (with-open-file (out (format nil "/proc/~D/clear_refs" pid) :direction :output
                                                               :if-exists :append)
     (write-line "5" out)
     t)))

;;; One row

(defstruct (row (:conc-name row-))
  kind framing path before peak clients correct seconds note judged)

(defun row-rise (row)
  (and (row-before row) (row-peak row) (- (row-peak row) (row-before row))))

(defun row-passed-p (row)
  (and (row-rise row)
       (<= (row-rise row) *goal-bytes*)
       (= (row-correct row) (row-clients row))
       (null (row-note row))))

(defun run-clients (server framing path payload bytes clients time-limit)
  "Run CLIENTS uploads at once; (values outcomes peak-rss seconds timed-out
sampled-peak high-water-mark).  The peak is the larger of the VmRSS samples
and the kernel's VmHWM, reset just before the clients start (a peak between
two samples is seen too)."
  (let* ((segments (request-segments path framing payload bytes))
         (expected (if (string= path "/upload") (princ-to-string bytes) "ignored"))
         (pid (server-pid server))
         (hwm-reset (reset-high-water-mark pid))
         (peak (or (rss-bytes pid) 0))
         (done nil)
         (sampler (sb-thread:make-thread
                   (lambda ()
                     (loop until done
                           do (let ((rss (rss-bytes pid)))
                                (when (and rss (> rss peak)) (setf peak rss)))
                              (sleep 0.05)))
                   :name "rss sampler"))
         (start (get-internal-real-time))
         (deadline (+ start (* time-limit internal-time-units-per-second)))
         (threads (loop for i below clients
                        collect (sb-thread:make-thread
                                 (lambda () (upload (server-port server) segments expected))
                                 :name (format nil "upload client ~D" i))))
         (timed-out nil))
    (loop while (some #'sb-thread:thread-alive-p threads)
          do (when (> (get-internal-real-time) deadline)
               ;; Killing the server ends every client's read and write.
               (setf timed-out t)
               (ignore-errors (sb-ext:process-kill (server-process server) 9))
               (return))
             (sleep 0.05))
    (let ((outcomes (mapcar (lambda (th)
                              (let ((v (sb-thread:join-thread th :default nil :timeout 30)))
                                (or v (make-outcome :message "client did not finish"))))
                            threads))
          (seconds (/ (- (get-internal-real-time) start) internal-time-units-per-second)))
      (let ((rss (rss-bytes pid)))
        (when (and rss (> rss peak)) (setf peak rss)))
      (setf done t)
      (sb-thread:join-thread sampler :default nil)
      (let ((hwm (and hwm-reset (status-bytes pid "VmHWM"))))
        (values outcomes (max peak (or hwm 0)) seconds timed-out peak hwm)))))

(defun settled-rss (server)
  "SERVER's VmRSS after a full GC and a moment of quiet."
  (server-command server "gc")
  (sleep 0.3)
  (rss-bytes (server-pid server)))

(defun run-row (server framing path payload plan)
  (let* ((kind (server-kind server))
         (before (settled-rss server)))
    (multiple-value-bind (outcomes peak seconds timed-out sampled hwm)
        (run-clients server framing path payload (plan-body-bytes plan) (plan-clients plan)
                     (kind-time-limit plan kind))
      (let* ((correct (count-if #'outcome-ok outcomes))
             (died (not (alive-p (server-process server))))
             (row (make-row :kind kind :framing framing :path path :before before :peak peak
                            :clients (length outcomes) :correct correct :seconds seconds
                            :judged (and (member kind *judged-kinds* :test #'string=) t)
                            :note (cond (timed-out (format nil "not done in ~D s: server killed"
                                                           (kind-time-limit plan kind)))
                                        (died "the server died")))))
        (say "~A ~A ~A: before ~,1F MiB, peak ~,1F MiB (sampled ~,1F, VmHWM ~:[-~;~:*~,1F~]), ~
              rise ~,1F MiB, ~D/~D answers correct, ~
              ~D/~D answered before the body was sent, ~,1F s~@[; ~A~]"
             kind (framing-name framing (plan-body-bytes plan)) path
             (mib (or before 0)) (mib peak) (mib sampled) (and hwm (mib hwm))
             (mib (or (row-rise row) 0)) correct (length outcomes)
             (count-if #'outcome-early outcomes) (length outcomes) seconds (row-note row))
        (loop for o in outcomes
              for i from 0
              unless (outcome-ok o)
                do (say "  client ~D: ~A" i (outcome-message o)))
        row))))

(defun warm-up (server payload plan)
  "Every row once with small bodies, not measured: the server's workers and
buffers exist before the first sample."
  (dolist (framing *framings*)
    (dolist (path *paths*)
      (let ((outcomes (run-clients server framing path payload *warm-up-bytes*
                                   (plan-clients plan) 60)))
        (unless (every #'outcome-ok outcomes)
          (say "warm-up ~A ~A: ~A" framing path
               (outcome-message (find-if-not #'outcome-ok outcomes))))))))

(defun start-warm-server (kind port payload plan)
  (let ((server (start-server kind port)))
    (say "~A server started (pid ~D); warming up" kind (server-pid server))
    (warm-up server payload plan)
    server))

(defun run-kind (kind index payload plan)
  "Every row for KIND; a list of ROWs."
  (let* ((port (+ (plan-port plan) 1 index))
         (server (start-warm-server kind port payload plan))
         (rows '()))
    (unwind-protect
         (dolist (framing *framings*)
           (dolist (path *paths*)
             (unless (alive-p (server-process server))
               (stop-server server)
               (setf server nil
                     server (start-warm-server kind port payload plan)))
             (push (run-row server framing path payload plan) rows)))
      (stop-server server))
    (nreverse rows)))

;;; Report

(defun print-table (rows plan)
  (format t "~&~%Uploads: ~D clients at once, each one ~:D-octet body (~D MiB), to 127.0.0.1; ~
             server VmRSS in MiB; goal: rise <= ~D MiB~%~%"
          (plan-clients plan) (plan-body-bytes plan) (round (plan-body-bytes plan) 1048576)
          (round *goal-bytes* 1048576))
  (format t "| front end | framing | path | RSS before | peak | rise | answers correct | seconds | |~%")
  (format t "|---|---|---|--:|--:|--:|--:|--:|---|~%")
  (dolist (row rows)
    (format t "| ~A | ~A | ~A | ~,1F | ~,1F | ~,1F | ~D/~D | ~,1F | ~A |~%"
            (row-kind row) (framing-name (row-framing row) (plan-body-bytes plan)) (row-path row)
            (mib (or (row-before row) 0)) (mib (or (row-peak row) 0))
            (mib (or (row-rise row) 0)) (row-correct row) (row-clients row) (row-seconds row)
            (cond ((row-note row) (row-note row))
                  ((not (row-judged row)) "not judged")
                  ((row-passed-p row) "ok")
                  (t "FAIL"))))
  (finish-output))

(defun main ()
  "Run every row for every kind, print the table, and exit (see the header)."
  (setf *start-time* (get-internal-real-time))
  (let ((code 2))
    (unwind-protect
         (handler-case
             (let* ((plan (make-plan-from-environment))
                    (payload (make-payload (plan-body-bytes plan)))
                    (rows (loop for kind in (plan-kinds plan)
                                append (run-kind kind (position kind *kinds* :test #'string=)
                                                 payload plan))))
               (print-table rows plan)
               (setf code (if (every #'row-passed-p (remove-if-not #'row-judged rows)) 0 1))
               (format t "~&~:[FAIL: a row of Gallop's kinds missed the goal or had a wrong answer~;~
                          PASS: every row of Gallop's kinds met the goal~]~%" (zerop code)))
           (error (e)
             (format *error-output* "~&bench-uploads: ~A~%" e)))
      (finish-output)
      (sb-ext:exit :code code :abort t))))
