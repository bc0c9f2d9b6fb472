;;;; server.lisp -- one benchmarked Lisp server, in its own SBCL process.
;;;;
;;;;   scripts/lisp.sh --load bench/server.lisp --end-toplevel-options KIND PORT SLEEP-MS
;;;;
;;;; KIND is one of
;;;;   stock      stock Hunchentoot: HUNCHENTOOT:EASY-ACCEPTOR, default taskmaster
;;;;              (one thread per connection); loads only Hunchentoot.
;;;;   gallop     Gallop's drop-in acceptor: GALLOP:EASY-ACCEPTOR.
;;;;   gallop-tm  a stock HUNCHENTOOT:EASY-ACCEPTOR with
;;;;              :TASKMASTER (MAKE-INSTANCE 'GALLOP:TASKMASTER).
;;;;   native     Gallop's native app API, GALLOP:START with a Clack-style app
;;;;              doing what /yo does; loads gallop/native (and Hunchentoot,
;;;;              only so that this file reads, not Gallop's Hunchentoot layer).
;;;; All listen on 127.0.0.1:PORT with access and message logging off (set
;;;; BENCH_MESSAGE_LOG=1 to send Hunchentoot's message log, i.e. errors, to
;;;; standard error, which the harness keeps in bench/results/tmp/logs/).
;;;;
;;;; The handler is seed 001's: an easy-handler /yo answering "Hey!" (or
;;;; "Hey NAME!") that calls SLEEP only when the sleep setting is above 0.
;;;; /big answers 1 MiB of octets (no sleep), for every kind: the soak test
;;;; (bench/soak.lisp) reads part of it and hangs up, so that the server's
;;;; writes fail in mid-response.  The benchmark itself only requests /yo.
;;;; The native server also answers /later, 5 s (BENCH_LATER_SECONDS) after
;;;; the request, from a timer (GALLOP:AFTER; bench/pending.lisp).
;;;; /upload reads the request body to its end in 64 KiB pieces and answers
;;;; the number of octets read (native: from :RAW-BODY; Hunchentoot: from
;;;; (HUNCHENTOOT:RAW-POST-DATA :WANT-STREAM T)); /ignore answers "ignored"
;;;; without reading the body.  bench/uploads.lisp (`make bench-uploads`)
;;;; measures the server's memory while clients upload to them.  /error
;;;; signals an error in the handler, and /stream streams /big's 1 MiB in
;;;; 16 KiB writes (Hunchentoot: to SEND-HEADERS's stream; native: a
;;;; writer) (bench/attacks.lisp).  /static answers the checkout's LICENSE
;;;; file (Hunchentoot: HANDLE-STATIC-FILE, whose head goes out through
;;;; SEND-HEADERS; native: a pathname body), for the restart drills
;;;; (tests/stress/restart.lisp).
;;;;
;;;; BENCH_TLS_CERT and BENCH_TLS_KEY (PEM files; `make bench-tls`) make
;;;; every kind answer HTTPS only: stock HUNCHENTOOT:EASY-SSL-ACCEPTOR,
;;;; GALLOP:EASY-SSL-ACCEPTOR, HUNCHENTOOT:EASY-SSL-ACCEPTOR with
;;;; GALLOP:TASKMASTER, and GALLOP:START with the certificate.
;;;;
;;;; BENCH_BESIDE_GALLOP=PORT (stock only): the process also loads Gallop
;;;; and runs a GALLOP:EASY-ACCEPTOR on PORT with the same handlers, so that
;;;; tests/hunchentoot/stock.lisp can show the stock acceptor answers as it
;;;; does in a process without Gallop.
;;;; BENCH_REUSE_PORT=1 (native and gallop) binds with :REUSE-PORT, so that
;;;; several of these processes serve one port (tests/stress/restart.lisp).
;;;; Gallop's kinds stop gracefully on SIGTERM (GALLOP:STOP-ON-SIGTERM).
;;;; BENCH_ACCESS_LOG=PATH (native) writes the access log to PATH, in the
;;;; Combined Log Format, or in JSON lines with BENCH_ACCESS_LOG_FORMAT=json.
;;;; BENCH_GALLOP_OPTIONS, a property list, adds any other Gallop settings
;;;; (experiments: "(:max-thread-count 2 :standby-thread-count 2)").
;;;; GALLOP_EPOLL_SETS sets the number of epoll sets (worker groups) of
;;;; Gallop's pool ("cpus": one per usable CPU, the default; 1: one for all
;;;; workers, the pool before the groups; see gallop.core::*group-count*), to
;;;; measure what they bring.
;;;; BENCH_MAX_HEAD_BYTES sets Gallop's :MAX-HEAD-BYTES (default 1 MiB; the
;;;; head-budget benchmark, bench/heads.lisp, lowers it to 65536).
;;;; BENCH_THREAD_IDLE_TIMEOUT (seconds) sets Gallop's :THREAD-IDLE-TIMEOUT
;;;; (default 10), and BENCH_TIMEOUT (seconds) the read and write timeouts,
;;;; from which Gallop's header and keep-alive idle timeouts default (20 s;
;;;; BENCH_IDLE_TIMEOUT still sets the idle one).  The soak test shortens
;;;; them so that soon after its load stops the pool is back to its standby
;;;; threads and no deadline of a closed connection is pending, before it
;;;; measures the server.
;;;;
;;;; Protocol with the harness (bench/run.lisp), on standard input/output:
;;;;   the server prints "READY <pid>" once it listens;
;;;;   "stats" -> one line "STATS <plist>" (GALLOP:STATS, or Hunchentoot's
;;;;              thread count for stock);
;;;;   "gc"    -> a full garbage collection, then "GC <dynamic usage in bytes>"
;;;;              (the soak test calls it before reading RSS, so that
;;;;              samples do not depend on when the last collection ran);
;;;;   "heap"  -> "HEAP <dynamic usage> <dynamic space size>" in bytes, without
;;;;              collecting (garbage included: what the heap holds now);
;;;;   "gc-stats" -> "GC-STATS <ms spent in GC> <bytes allocated>", both since
;;;;              the start (per request: the difference over a run);
;;;;   "perf-map" -> writes /tmp/perf-PID.map (bench/perf-map.lisp), so that
;;;;              `perf report` names Lisp functions; "PERF-MAP <lines>";
;;;;   "quit" or end of file -> exit at once.  End of file means the harness is
;;;;   gone, so a crashed harness never leaves a server behind.
;;;; Everything else the process prints (compiler chatter, errors) goes to
;;;; standard error.

(defpackage #:gallop-bench-server
  (:use #:common-lisp))
(in-package #:gallop-bench-server)

(defvar *protocol* sb-sys:*stdout*
  "The harness reads this stream; nothing but protocol lines is written to it.")

;; Keep stdout clean: compiler output and warnings go to stderr.
(setf *standard-output* *error-output*)

(defun user-args ()
  ;; SBCL removes its own options, --end-toplevel-options included.
  (rest sb-ext:*posix-argv*))

(defun die (control &rest args)
  (format *error-output* "~&bench server: ~?~%" control args)
  (finish-output *error-output*)
  (sb-ext:exit :code 2 :abort t))

(defvar *kind*)
(defvar *port*)
(defvar *sleep-ms*)

(let ((args (user-args)))
  (unless (and (= (length args) 3)
               (member (first args) '("stock" "gallop" "gallop-tm" "native") :test #'string=))
    (die "usage: server.lisp --end-toplevel-options stock|gallop|gallop-tm|native PORT SLEEP-MS"))
  (setf *kind* (intern (string-upcase (first args)) :keyword)
        *port* (parse-integer (second args))
        *sleep-ms* (parse-integer (third args))))

;; Stock Hunchentoot loads Hunchentoot alone: Gallop's methods on Hunchentoot's
;; generic functions are not even present in that process (unless
;; BENCH_BESIDE_GALLOP asks for a Gallop acceptor beside it).
(defparameter *beside-port*
  (let ((v (uiop:getenv "BENCH_BESIDE_GALLOP")))
    (and v (plusp (length v)) (eq *kind* :stock) (parse-integer v))))
(asdf:load-system (case *kind* (:stock "hunchentoot") (:native "gallop/native") (t "gallop")))
(when *beside-port*
  (asdf:load-system "gallop"))
;; This file names Hunchentoot's symbols, so the reader needs the package even
;; for the native server, which never starts an acceptor.
(asdf:load-system "hunchentoot")

(defparameter *handler-sleep-seconds* (/ *sleep-ms* 1000)
  "Seed 001's sleep setting.")

(hunchentoot:define-easy-handler (yo :uri "/yo") (name)
  (setf (hunchentoot:content-type*) "text/plain")
  (when (plusp *handler-sleep-seconds*)
    (sleep *handler-sleep-seconds*))
  (format nil "Hey~@[ ~A~]!" name))

(defparameter *big-body*
  (let ((body (make-array (* 1024 1024) :element-type '(unsigned-byte 8))))
    (dotimes (i (length body) body)
      (setf (aref body i) (+ 97 (mod i 26)))))
  "The 1 MiB answer of /big: letters, built once.")

(defparameter *later-seconds*
  (let ((v (uiop:getenv "BENCH_LATER_SECONDS")))
    (if (and v (plusp (length v))) (parse-integer v) 5))
  "How long /later waits before it answers (native only; bench/pending.lisp).")

(hunchentoot:define-easy-handler (later :uri "/later") ()
  ;; Gallop's kinds only (bench/pending.lisp): answered *LATER-SECONDS*
  ;; later by a timer, the worker let go (GALLOP:DEFER-REQUEST).
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((answer (funcall (gallop-symbol "DEFER-REQUEST"))))
    (funcall (gallop-symbol "AFTER") *later-seconds* (lambda () (funcall answer "Hey!")))
    nil))

(defparameter *static-file*
  (uiop:merge-pathnames* "LICENSE" (uiop:pathname-parent-directory-pathname
                                    (uiop:pathname-directory-pathname *load-truename*)))
  "The file /static answers.")

(hunchentoot:define-easy-handler (static :uri "/static") ()
  (hunchentoot:handle-static-file *static-file* "text/plain"))

(hunchentoot:define-easy-handler (big :uri "/big") ()
  (setf (hunchentoot:content-type*) "application/octet-stream")
  *big-body*)

(defconstant +stream-piece-bytes+ 16384
  "The size of /stream's writes.")

(hunchentoot:define-easy-handler (stream-big :uri "/stream") ()
  (setf (hunchentoot:content-type*) "application/octet-stream"
        (hunchentoot:content-length*) (length *big-body*))
  (let ((out (hunchentoot:send-headers)))
    (loop for start from 0 below (length *big-body*) by +stream-piece-bytes+
          do (write-sequence *big-body* out :start start
                                            :end (min (length *big-body*)
                                                      (+ start +stream-piece-bytes+))))
    (finish-output out)
    nil))

;;; Uploads (bench/uploads.lisp)

(defconstant +upload-piece-bytes+ 65536
  "The size of the pieces /upload reads a body in.")

(defun count-body (stream)
  "Read the body STREAM to its end in pieces of +UPLOAD-PIECE-BYTES+ (one
buffer per request, reused), keeping nothing; the number of octets read."
  (let ((buffer (make-array +upload-piece-bytes+ :element-type '(unsigned-byte 8)))
        (total 0))
    (declare (type fixnum total))
    ;; Until a read returns nothing: READ-SEQUENCE returns a short count
    ;; only at end of file, but a Gray stream need not.
    (loop for n of-type fixnum = (read-sequence buffer stream)
          until (zerop n)
          do (incf total n))
    total))

(hunchentoot:define-easy-handler (upload :uri "/upload") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (princ-to-string (count-body (hunchentoot:raw-post-data :want-stream t))))

(hunchentoot:define-easy-handler (ignore-upload :uri "/ignore") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "ignored")

;;; Errors (bench/attacks.lisp): a handler that signals one, as a bug a
;;; client can reach does.

(hunchentoot:define-easy-handler (fail :uri "/error") ()
  (error "The handler of /error failed, as it always does."))

(defun query-parameter (query name)
  "The value of NAME in the query string QUERY (no decoding: the benchmark's
names are plain)."
  (when query
    (let ((prefix (concatenate 'string name "=")))
      (loop for part in (uiop:split-string query :separator "&")
            when (uiop:string-prefix-p prefix part)
              return (subseq part (length prefix))))))

(defun native-app (env)
  "The native counterpart of /yo, /static, /big, /stream, /upload and /ignore; and /later,
answered \"Hey!\" *LATER-SECONDS* after the request by a timer
\(GALLOP:AFTER), with no thread waiting: cl-async's seed test."
  (let ((path (getf env :path-info)))
    (cond ((string= path "/later")
           (lambda (responder)
             (funcall (gallop-symbol "AFTER") *later-seconds*
                      (lambda ()
                        (funcall responder '(200 (:content-type "text/plain") ("Hey!")))))))
          ((string= path "/yo")
           (when (plusp *handler-sleep-seconds*)
             (sleep *handler-sleep-seconds*))
           ;; The same answer as /yo, built the way a native app would:
           ;; without FORMAT, whose directive interpreter costs more than
           ;; the rest of this app.
           (let ((name (query-parameter (getf env :query-string) "name")))
             (list 200 '(:content-type "text/plain")
                   (list (if name (concatenate 'string "Hey " name "!") "Hey!")))))
          ((string= path "/static")
           (list 200 '(:content-type "text/plain") *static-file*))
          ((string= path "/big")
           (list 200 '(:content-type "application/octet-stream") *big-body*))
          ((string= path "/stream")
           (lambda (responder)
             (let ((writer (funcall responder
                                    (list 200 (list :content-type "application/octet-stream"
                                                    :content-length (length *big-body*))))))
               (loop for start from 0 below (length *big-body*) by +stream-piece-bytes+
                     do (funcall writer (subseq *big-body* start
                                                (min (length *big-body*)
                                                     (+ start +stream-piece-bytes+)))))
               (funcall writer nil :close t))))
          ((string= path "/upload")
           (list 200 '(:content-type "text/plain")
                 (list (princ-to-string (count-body (getf env :raw-body))))))
          ((string= path "/ignore")
           '(200 (:content-type "text/plain") ("ignored")))
          ((string= path "/error")
           (error "The app failed at /error, as it always does."))
          (t
           '(404 (:content-type "text/plain") ("Not Found"))))))

(defun gallop-symbol (name)
  (or (find-symbol name "GALLOP") (die "GALLOP:~A not found" name)))

(defparameter *message-log*
  (and (uiop:getenv "BENCH_MESSAGE_LOG")
       (string/= (uiop:getenv "BENCH_MESSAGE_LOG") "0")
       *error-output*)
  "Where errors are logged (standard error), or NIL for nowhere.")

(defparameter *log-args*
  (list :access-log-destination nil
        :message-log-destination *message-log*))

(defvar *taskmaster* nil)

(defparameter *idle-timeout*
  (let ((v (uiop:getenv "BENCH_IDLE_TIMEOUT")))
    (and v (plusp (length v)) (parse-integer v)))
  "Seconds Gallop keeps an idle keep-alive connection (default: its own, the
read timeout, 20 s).  Holding ~19,000 idle connections takes longer than 20 s
to set up, so that run raises it.")

(defparameter *thread-idle-timeout*
  (let ((v (uiop:getenv "BENCH_THREAD_IDLE_TIMEOUT")))
    (and v (plusp (length v)) (parse-integer v)))
  "Seconds an idle worker beyond the standby count stays in Gallop's pool
(default: Gallop's own, 10 s).")

(defparameter *timeout*
  (let ((v (uiop:getenv "BENCH_TIMEOUT")))
    (and v (plusp (length v)) (parse-integer v)))
  "Seconds for the acceptor's read and write timeouts, and so for Gallop's
header and idle timeouts (default: 20 s).")

(defparameter *max-head-bytes*
  (let ((v (uiop:getenv "BENCH_MAX_HEAD_BYTES")))
    (and v (plusp (length v)) (parse-integer v)))
  "Gallop's :MAX-HEAD-BYTES (default: its own, 1 MiB).")

(defparameter *extra-options*
  (let ((v (uiop:getenv "BENCH_GALLOP_OPTIONS")))
    (and v (plusp (length v))
         (let ((*read-eval* nil) (*package* (find-package :keyword)))
           (read-from-string v))))
  "More settings for Gallop, a property list read from BENCH_GALLOP_OPTIONS
\(e.g. \"(:max-thread-count 2 :standby-thread-count 2)\"), for experiments.")

(let ((v (uiop:getenv "GALLOP_EPOLL_SETS")))
  ;; The number of epoll sets (worker groups) Gallop's pool starts with,
  ;; instead of one per CPU: for measuring what the groups bring.  (Read at
  ;; run time: the stock server does not load Gallop.)
  ;; "cpus": one per usable CPU.
  (when (and v (plusp (length v)) (find-package "GALLOP.CORE"))
    (setf (symbol-value (find-symbol "*GROUP-COUNT*" "GALLOP.CORE"))
          (if (string-equal v "cpus") nil (parse-integer v)))))

(defun gallop-options ()
  "The pool and keep-alive timeouts and the head limit set from the
environment, as initargs of GALLOP:TASKMASTER and keywords of GALLOP:START
alike, then BENCH_GALLOP_OPTIONS."
  (append *extra-options*
          (and *idle-timeout* (list :idle-timeout *idle-timeout*))
          (and *thread-idle-timeout* (list :thread-idle-timeout *thread-idle-timeout*))
          (and *max-head-bytes* (list :max-head-bytes *max-head-bytes*))))

(defun acceptor-timeout-args ()
  "The read and write timeouts of a Hunchentoot acceptor, from BENCH_TIMEOUT."
  (and *timeout* (list :read-timeout *timeout* :write-timeout *timeout*)))

(defun native-timeout-args ()
  "GALLOP:START's timeouts from BENCH_TIMEOUT (after GALLOP-OPTIONS, whose
:IDLE-TIMEOUT comes first and so wins)."
  (and *timeout* (list :read-timeout *timeout* :write-timeout *timeout*
                       :header-timeout *timeout* :idle-timeout *timeout*)))

(defparameter *tls*
  (let ((cert (uiop:getenv "BENCH_TLS_CERT"))
        (key (uiop:getenv "BENCH_TLS_KEY")))
    (and cert (plusp (length cert)) (list cert key)))
  "The certificate and key files to answer HTTPS with, or NIL.")

(defun tls-initargs ()
  "A Hunchentoot SSL acceptor's certificate initargs, from *TLS*."
  (list :ssl-certificate-file (first *tls*) :ssl-privatekey-file (second *tls*)))

(defparameter *reuse-port*
  (equal "1" (uiop:getenv "BENCH_REUSE_PORT"))
  "True: Gallop's kinds bind with :REUSE-PORT.")

(defun gallop-taskmaster ()
  (apply #'make-instance (gallop-symbol "TASKMASTER") (gallop-options)))

(defparameter *acceptor*
  (case *kind*
    (:stock
     (apply #'make-instance (if *tls* 'hunchentoot:easy-ssl-acceptor 'hunchentoot:easy-acceptor)
            :address "127.0.0.1" :port *port*
            (append (and *tls* (tls-initargs)) (acceptor-timeout-args) *log-args*)))
    (:gallop
     (apply #'make-instance (gallop-symbol (if *tls* "EASY-SSL-ACCEPTOR" "EASY-ACCEPTOR"))
            :address "127.0.0.1" :port *port* :taskmaster (gallop-taskmaster)
            :reuse-port *reuse-port*
            (append (and *tls* (tls-initargs)) (acceptor-timeout-args) *log-args*)))
    (:gallop-tm
     (setf *taskmaster* (gallop-taskmaster))
     (apply #'make-instance (if *tls* 'hunchentoot:easy-ssl-acceptor 'hunchentoot:easy-acceptor)
            :address "127.0.0.1" :port *port* :taskmaster *taskmaster*
            (append (and *tls* (tls-initargs)) (acceptor-timeout-args) *log-args*)))))

(defvar *native-server* nil)

(defun stats ()
  (ecase *kind*
    (:native (funcall (gallop-symbol "STATS") *native-server*))
    (:stock (list :threads (hunchentoot:taskmaster-thread-count
                            (hunchentoot::acceptor-taskmaster *acceptor*))))
    (:gallop (funcall (gallop-symbol "STATS") *acceptor*))
    (:gallop-tm (funcall (gallop-symbol "STATS") *taskmaster*))))

(defun reply (control &rest args)
  (let ((*print-pretty* nil))
    (format *protocol* "~?~%" control args))
  (finish-output *protocol*))

(handler-case (if (eq *kind* :native)
                  (setf *native-server*
                        (apply (gallop-symbol "START") #'native-app
                               :address "127.0.0.1" :port *port* :log *message-log*
                               :reuse-port *reuse-port*
                               (append (gallop-options) (native-timeout-args)
                                       (let ((path (uiop:getenv "BENCH_ACCESS_LOG")))
                                         (and path (plusp (length path))
                                              (list :access-log path
                                                    :access-log-format
                                                    (if (equal (uiop:getenv "BENCH_ACCESS_LOG_FORMAT")
                                                               "json")
                                                        :json :combined))))
                                       (and *tls* (list :ssl-certificate-file (first *tls*)
                                                        :ssl-privatekey-file (second *tls*))))))
                  (funcall (find-symbol "START" "HUNCHENTOOT") *acceptor*))
  (error (e) (die "cannot start ~(~A~) on port ~D: ~A" *kind* *port* e)))

(when *beside-port*
  (handler-case (hunchentoot:start (apply #'make-instance (gallop-symbol "EASY-ACCEPTOR")
                                         :address "127.0.0.1" :port *beside-port* *log-args*))
    (error (e) (die "cannot start Gallop beside on port ~D: ~A" *beside-port* e))))

(unless (eq *kind* :stock)
  (funcall (gallop-symbol "STOP-ON-SIGTERM")))

(reply "READY ~D" (sb-unix:unix-getpid))

(handler-case
    (loop for line = (read-line *standard-input* nil)
          while line
          do (let ((command (string-trim " " line)))
               (cond ((string= command "stats")
                      (reply "STATS ~S" (ignore-errors (stats))))
                     ((string= command "gc")
                      (sb-ext:gc :full t)
                      (reply "GC ~D" (sb-kernel:dynamic-usage)))
                     ((string= command "heap")
                      (reply "HEAP ~D ~D" (sb-kernel:dynamic-usage)
                             (sb-ext:dynamic-space-size)))
                     ((string= command "gc-stats")
                      (reply "GC-STATS ~D ~D" (round (* 1000 sb-ext:*gc-run-time*)
                                                     internal-time-units-per-second)
                             (sb-ext:get-bytes-consed)))
                     ((string= command "perf-map")
                      ;; perf(1) names Lisp functions from /tmp/perf-PID.map.
                      (require :sb-posix)
                      (load (merge-pathnames "perf-map.lisp" *load-truename*))
                      (reply "PERF-MAP ~D" (funcall (intern "WRITE-PERF-MAP" *package*))))
                     ((string= command "quit")
                      (return)))))
  (sb-sys:interactive-interrupt () nil)
  (error (e) (format *error-output* "~&bench server: control loop: ~A~%" e)))

;; No graceful stop: the harness measures serving, not shutting down, and a
;; stock Hunchentoot with busy threads could take a while to stop.
(sb-ext:exit :code 0 :abort t)
