;;;; process.lisp -- helpers shared by every Lisp harness of bench/, which
;;;; each load this file first: settings from the environment, child
;;;; processes and the bench/server.lisp servers among them, /proc, wrk's
;;;; numbers, a fresh client, and small helpers (clock, octets, medians).
;;;; The harnesses start servers and load generators as child processes and
;;;; talk to them over pipes, with every wait bounded.

(defpackage #:gallop-bench-process
  (:use #:common-lisp)
  (:export
   ;; settings and programs
   #:env #:env-int #:env-list #:env-choices #:find-program #:timestamp #:*repo* #:lisp-sh
   ;; child processes, bench/server.lisp's among them
   #:alive-p #:wait-exit #:kill-and-reap #:read-line-timeout #:start-bench-server
   #:environment-with #:ask-process #:ask-stats #:ask-gc #:quit-process #:raise-fd-limit
   ;; /proc, TLS, a fresh client
   #:usable-cpus #:proc-status #:proc-field #:fd-count #:make-tls-certificate #:fetch #:probe-yo
   ;; the clock, octets, medians, wrk's report
   #:*start-time* #:elapsed #:clock #:now-ms #:ascii #:upper-median
   #:parse-decimal #:wrk-words #:wrk-ms #:parse-wrk))
(in-package #:gallop-bench-process)

(defparameter *repo*
  (uiop:pathname-parent-directory-pathname
   (uiop:pathname-directory-pathname (or *load-truename* *default-pathname-defaults*)))
  "The checkout this file belongs to.")

(defun lisp-sh ()
  "The checkout's scripts/lisp.sh, which child Lisp processes run."
  (namestring (merge-pathnames "scripts/lisp.sh" *repo*)))

(defun env (name)
  "The environment variable NAME, trimmed, or NIL when unset or blank."
  (let ((v (uiop:getenv name)))
    (and v (plusp (length (string-trim " " v))) (string-trim " " v))))

(defun env-int (name default)
  "The integer in the environment variable NAME (underscores allowed as
separators: 2_000_000), or DEFAULT when unset."
  (let ((v (env name)))
    (if v
        (or (parse-integer (remove #\_ v) :junk-allowed t)
            (error "~A=~S is not an integer" name v))
        default)))

(defun env-list (name default)
  "The comma-separated words of the environment variable NAME, trimmed, or
DEFAULT when unset."
  (let ((v (env name)))
    (if v
        (remove "" (mapcar (lambda (s) (string-trim " " s)) (uiop:split-string v :separator ","))
                :test #'string=)
        default)))

(defun env-choices (name what known default)
  "The comma-separated words of the environment variable NAME (ENV-LIST),
each one of the strings KNOWN, or DEFAULT when unset; an error, saying WHAT
the words name, on an unknown one."
  (let ((words (env-list name :unset)))
    (if (eq words :unset)
        default
        (dolist (word words words)
          (unless (member word known :test #'string=)
            (error "~A: unknown ~A ~S (known: ~{~A~^, ~})" name what word known))))))

(defun alive-p (process)
  "True while PROCESS runs (or is stopped)."
  (and process (member (sb-ext:process-status process) '(:running :stopped))))

(defun find-program (name &rest extra-dirs)
  "The path of the program NAME in PATH or in EXTRA-DIRS, or NIL."
  (loop for dir in (append (uiop:split-string (or (uiop:getenv "PATH") "") :separator ":")
                           extra-dirs)
        for path = (format nil "~A/~A" (string-right-trim "/" dir) name)
        when (and (plusp (length dir)) (probe-file path))
          return path))

(defun timestamp (&optional (time (get-universal-time)) (style :id))
  "TIME as a run's id (20261202-163000), or with STYLE :HUMAN as
2026-12-02 16:30."
  (multiple-value-bind (s mi h d mo y) (decode-universal-time time)
    (ecase style
      (:id (format nil "~D~2,'0D~2,'0D-~2,'0D~2,'0D~2,'0D" y mo d h mi s))
      (:human (format nil "~D-~2,'0D-~2,'0D ~2,'0D:~2,'0D" y mo d h mi)))))

(defun wait-exit (process seconds)
  "Wait up to SECONDS for PROCESS to exit; true if it did."
  (loop with deadline = (+ (get-internal-real-time) (* seconds internal-time-units-per-second))
        while (alive-p process)
        do (when (> (get-internal-real-time) deadline)
             (return-from wait-exit nil))
           (sleep 0.05))
  t)

(defun kill-and-reap (process)
  "SIGTERM PROCESS, SIGKILL it after 3 s, and release it."
  (when (alive-p process)
    (ignore-errors (sb-ext:process-kill process 15))
    (unless (wait-exit process 3)
      (ignore-errors (sb-ext:process-kill process 9))
      (wait-exit process 5)))
  (ignore-errors (sb-ext:process-close process)))

(defun read-line-timeout (stream seconds)
  "The next line of STREAM, or NIL at end of file or after SECONDS."
  (let ((deadline (+ (get-internal-real-time) (* seconds internal-time-units-per-second))))
    (loop
      (let ((c (read-char-no-hang stream nil :eof)))
        (cond ((eq c :eof) (return nil))
              (c (unread-char c stream) (return (read-line stream nil)))
              ((> (get-internal-real-time) deadline) (return nil))
              (t (sb-sys:wait-until-fd-usable (sb-sys:fd-stream-fd stream) :input 0.1)))))))

;;; bench/server.lisp children (see its header for the protocol)

(defun start-bench-server (kind port &key environment log (if-log-exists :append) (timeout 180)
                                          nofile (script "bench/server.lisp") (more '("0")))
  "Start SCRIPT (bench/server.lisp) as KIND on PORT, then the arguments MORE
\(server.lisp's handler sleep, 0 ms), in a child process with ENVIRONMENT
\(default: this one's), its standard error appended to LOG (or superseding
it, IF-LOG-EXISTS), and wait up to TIMEOUT seconds for its READY line.
NOFILE: the child's fd limit, soft and hard (prlimit(1), from its start).
Returns the process and the server's pid; if it does not start, kills it and
signals an error."
  (let* ((arguments (list* "--load" script "--end-toplevel-options"
                           kind (princ-to-string port) more))
         (process (sb-ext:run-program (if nofile "prlimit" (lisp-sh))
                                      (if nofile
                                          (list* (format nil "--nofile=~D:~D" nofile nofile) "--"
                                                 (lisp-sh) arguments)
                                          arguments)
                                      :search (and nofile t)
                                      :directory (namestring *repo*) :wait nil
                                      :environment (or environment (sb-ext:posix-environ))
                                      :input :stream :output :stream
                                      :error (namestring log) :if-error-exists if-log-exists))
         (line (read-line-timeout (sb-ext:process-output process) timeout)))
    (unless (and line (uiop:string-prefix-p "READY " line))
      (kill-and-reap process)
      (error "The ~A server did not start (~:[no READY within ~D s~;~:*it said ~S~*~]); see ~A"
             kind line timeout (enough-namestring log *repo*)))
    (values process (parse-integer line :start 6 :junk-allowed t))))

(defun ask-process (process command prefix &optional (timeout 10))
  "Send COMMAND to the bench/server.lisp child PROCESS; the rest of its answer
line after PREFIX, or NIL (no answer within TIMEOUT seconds, or the child is
gone)."
  (when (and (alive-p process)
             (ignore-errors
              (let ((in (sb-ext:process-input process)))
                (write-line command in)
                (finish-output in)
                t)))
    (let ((line (read-line-timeout (sb-ext:process-output process) timeout)))
      (and line (uiop:string-prefix-p prefix line) (subseq line (length prefix))))))

(defun environment-with (settings &key drop drop-prefix)
  "This process's environment for a child: SETTINGS (\"NAME=VALUE\"
strings) first, then every variable of this one except those SETTINGS set,
those DROP names, and those whose name starts with DROP-PREFIX."
  (flet ((name (var) (subseq var 0 (or (position #\= var) (length var)))))
    (let ((set (mapcar #'name settings)))
      (append settings
              (remove-if (lambda (var)
                           (let ((name (name var)))
                             (or (member name set :test #'string=)
                                 (member name drop :test #'string=)
                                 (and drop-prefix (uiop:string-prefix-p drop-prefix name)))))
                         (sb-ext:posix-environ))))))

(defun ask-stats (process &optional (timeout 10))
  "GALLOP:STATS of the bench/server.lisp child PROCESS (its \"stats\"
command) as a property list, or NIL."
  (let ((text (ask-process process "stats" "STATS " timeout)))
    (and text (ignore-errors (let ((*read-eval* nil) (*package* (find-package :keyword)))
                               (read-from-string text))))))

(defun ask-gc (process &optional (timeout 60))
  "A full GC in the bench/server.lisp child PROCESS (its \"gc\" command):
its heap in use after it, in octets, or NIL."
  (let ((text (ask-process process "gc" "GC " timeout)))
    (and text (parse-integer text :junk-allowed t))))

(defun quit-process (process)
  "Tell the bench/server.lisp child PROCESS to quit and close its input; give
it 5 s to exit, then KILL-AND-REAP it."
  (ignore-errors
   (let ((in (sb-ext:process-input process)))
     (write-line "quit" in)
     (finish-output in)
     (close in)))
  (wait-exit process 5)
  (kill-and-reap process))

;;; File descriptors: the load generators open thousands of connections.

(defconstant +rlimit-nofile+ 7)

(sb-alien:define-alien-routine ("getrlimit" %getrlimit) sb-alien:int
  (resource sb-alien:int) (rlim sb-sys:system-area-pointer))
(sb-alien:define-alien-routine ("setrlimit" %setrlimit) sb-alien:int
  (resource sb-alien:int) (rlim sb-sys:system-area-pointer))

(defun raise-fd-limit ()
  "Raise this process's soft RLIMIT_NOFILE to the hard limit; return the
soft limit."
  (sb-alien:with-alien ((lim (array (sb-alien:unsigned 64) 2)))
    (let ((sap (sb-alien:alien-sap lim)))
      (%getrlimit +rlimit-nofile+ sap)
      (let ((soft (sb-sys:sap-ref-64 sap 0))
            (hard (sb-sys:sap-ref-64 sap 8)))
        ;; An unlimited hard limit cannot be the soft one (nr_open caps it).
        (dolist (target (list hard (min hard 1048576) (min hard 65536)) soft)
          (when (> target soft)
            (setf (sb-sys:sap-ref-64 sap 0) target)
            (when (zerop (%setrlimit +rlimit-nofile+ sap))
              (return target))))))))

;;; A fresh client

(require :sb-bsd-sockets)

(defvar *start-time* 0
  "Internal real time when the harness began; it sets this.")

(defun elapsed ()
  "Seconds since *START-TIME*."
  (/ (- (get-internal-real-time) *start-time*) internal-time-units-per-second))

(defun clock (seconds)
  "SECONDS as minutes and seconds: 3:07."
  (multiple-value-bind (m s) (floor (round seconds) 60)
    (format nil "~D:~2,'0D" m s)))

(defun now-ms ()
  "Milliseconds of internal real time."
  (values (floor (* 1000 (get-internal-real-time)) internal-time-units-per-second)))

(defun ascii (string)
  "STRING's characters as octets."
  (map '(simple-array (unsigned-byte 8) (*)) #'char-code string))

(defun upper-median (list &optional empty)
  "The middle of the numbers in LIST (of two middle ones, the upper), or
EMPTY when it has none.  NILs in LIST do not count."
  (let ((sorted (sort (remove nil (copy-list list)) #'<)))
    (if sorted (nth (floor (length sorted) 2) sorted) empty)))

;;; wrk's report

(defun parse-decimal (string)
  "A plain decimal number (\"12\", \"-3.25\", \"1.5e3\") as a double, or NIL."
  (let ((s (string-trim " " (or string ""))))
    (when (and (plusp (length s))
               (every (lambda (c) (or (digit-char-p c) (find c "+-.eE"))) s)
               (some #'digit-char-p s))
      (handler-case
          (let ((*read-default-float-format* 'double-float)
                (*read-eval* nil))
            (let ((value (read-from-string s)))
              (and (realp value) (coerce value 'double-float))))
        (error () nil)))))

(defun wrk-words (line)
  "The words of a line of wrk's report: split at spaces, tabs and commas."
  (remove "" (uiop:split-string line :separator '(#\Space #\Tab #\,)) :test #'string=))

(defun wrk-ms (token)
  "A duration of wrk's report (\"850.00us\", \"5.01s\", \"3.2m\") in
milliseconds, or NIL."
  (let* ((end (or (position-if-not (lambda (c) (or (digit-char-p c) (find c ".-+"))) token)
                  (length token)))
         (x (parse-decimal (subseq token 0 end)))
         (scale (cdr (assoc (subseq token end)
                            '(("us" . 1/1000) ("ms" . 1) ("s" . 1000) ("m" . 60000)
                              ("h" . 3600000) ("" . 1))
                            :test #'string=))))
    (and x scale (* x scale))))

(defun parse-wrk (text)
  "The numbers of wrk's report TEXT as a property list: :REQUESTS (an
integer) and :DURATION (s) of its \"N requests in T\" line, :RPS, :MAX (ms,
the slowest answer), :P50, :P75, :P90 and :P99 (ms, with --latency): NIL
where wrk printed none; the socket errors :CONNECT, :READ, :WRITE and
:TIMEOUT, and :NON2XX: integers, 0 where wrk printed none."
  (let ((r (list :requests nil :duration nil :rps nil :max nil :p50 nil :p75 nil :p90 nil :p99 nil
                 :connect 0 :read 0 :write 0 :timeout 0 :non2xx 0)))
    (dolist (line (uiop:split-string text :separator '(#\Newline)) r)
      (let ((w (wrk-words line)))
        (cond ((null w))
              ((and (string= (first w) "Requests/sec:") (second w))
               (setf (getf r :rps) (parse-decimal (second w))))
              ((and (>= (length w) 4) (string= (second w) "requests") (string= (third w) "in"))
               (setf (getf r :requests) (parse-integer (first w) :junk-allowed t)
                     (getf r :duration) (let ((ms (wrk-ms (fourth w)))) (and ms (/ ms 1000)))))
              ((and (>= (length w) 5) (string= (first w) "Latency"))
               (setf (getf r :max) (wrk-ms (fourth w))))
              ((and (= (length w) 2) (member (first w) '("50%" "75%" "90%" "99%") :test #'string=))
               (setf (getf r (intern (format nil "P~A" (string-right-trim "%" (first w))) :keyword))
                     (wrk-ms (second w))))
              ((and (string= (first w) "Socket") (equal (second w) "errors:"))
               (loop for (k v) on (cddr w) by #'cddr
                     for key = (find k '(:connect :read :write :timeout) :test #'string-equal)
                     when key do (setf (getf r key) (or (parse-integer v :junk-allowed t) 0))))
              ((search "Non-2xx or 3xx responses:" line)
               (setf (getf r :non2xx) (or (parse-integer (car (last w)) :junk-allowed t) 0))))))))

(defun fetch (port path)
  "GET PATH with Connection: close on a fresh connection to PORT: the octets
of the whole answer, up to the server's close, or NIL if that failed."
  (let ((s (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (unwind-protect
         (ignore-errors
          (sb-bsd-sockets:socket-connect s #(127 0 0 1) port)
          (let ((stream (sb-bsd-sockets:socket-make-stream s :input t :output t :timeout 10
                                                             :element-type '(unsigned-byte 8))))
            (write-sequence (map '(simple-array (unsigned-byte 8) (*)) #'char-code
                                 (format nil "GET ~A HTTP/1.1~C~CHost: b~C~CConnection: close~C~C~C~C"
                                           path #\Return #\Linefeed #\Return #\Linefeed
                                           #\Return #\Linefeed #\Return #\Linefeed))
                            stream)
            (finish-output stream)
            (coerce (loop for b = (read-byte stream nil) while b collect b)
                    '(simple-array (unsigned-byte 8) (*)))))
      (ignore-errors (sb-bsd-sockets:socket-close s)))))

(defun probe-yo (port)
  "One fresh client: GET /yo, Connection: close.  Milliseconds to the whole
exact answer, or NIL."
  (let* ((start (now-ms))
         (octets (fetch port "/yo")))
    (when octets
      (let* ((text (map 'string #'code-char octets))
             (head-end (search (format nil "~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed)
                               text))
             (length-at (search (format nil "~C~CContent-Length: " #\Return #\Linefeed) text
                                :test #'char-equal)))
        (and head-end length-at
             (uiop:string-prefix-p (format nil "HTTP/1.1 200 OK~C~C" #\Return #\Linefeed) text)
             (eql 4 (parse-integer text :start (+ length-at 18) :junk-allowed t))
             (string= "Hey!" (subseq text (+ head-end 4)))
             (- (now-ms) start))))))

;;; /proc, and TLS

(defun usable-cpus ()
  "The CPUs this process may use: nproc(1), its affinity mask."
  (parse-integer (uiop:run-program "nproc" :output :string) :junk-allowed t))

(defun fd-count (pid)
  "Open file descriptors of PID: the entries of /proc/PID/fd."
  (length (directory (format nil "/proc/~D/fd/*" pid) :resolve-symlinks nil)))

(defun proc-field (pid field)
  "The number after FIELD: in /proc/PID/status, or NIL."
  (with-open-file (in (format nil "/proc/~D/status" pid) :if-does-not-exist nil)
    (and in (loop for line = (read-line in nil) while line
                  when (uiop:string-prefix-p (format nil "~A:" field) line)
                    return (parse-integer line :start (1+ (length field)) :junk-allowed t)))))

(defun proc-status (pid)
  "VmRSS in KiB and the thread count of PID, from /proc/PID/status."
  (let ((rss nil) (threads nil))
    (ignore-errors
     (with-open-file (in (format nil "/proc/~D/status" pid))
       (loop for line = (read-line in nil)
             while line
             do (cond ((uiop:string-prefix-p "VmRSS:" line)
                       (setf rss (parse-integer line :start 6 :junk-allowed t)))
                      ((uiop:string-prefix-p "Threads:" line)
                       (setf threads (parse-integer line :start 8 :junk-allowed t)))))))
    (values rss threads)))

(defun make-tls-certificate (dir)
  "A self-signed RSA-2048 certificate for 127.0.0.1 and its key, made with
openssl in DIR: the two namestrings, as a list."
  (let ((cert (namestring (merge-pathnames "cert.pem" dir)))
        (key (namestring (merge-pathnames "key.pem" dir))))
    (ensure-directories-exist dir)
    (multiple-value-bind (out error code)
        (uiop:run-program (list "openssl" "req" "-x509" "-newkey" "rsa:2048" "-nodes"
                                "-keyout" key "-out" cert "-days" "2" "-subj" "/CN=127.0.0.1")
                          :output :string :error-output :string :ignore-error-status t)
      (declare (ignore out))
      (unless (eql code 0)
        (error "openssl could not make a certificate: ~A" error)))
    (list cert key)))
