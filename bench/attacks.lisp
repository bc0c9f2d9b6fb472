;;;; attacks.lisp -- `make bench-attacks`: what cheap attacks cost each
;;;; server, while a fresh client asks for /yo.
;;;;
;;;;   scripts/lisp.sh --load bench/attacks.lisp --eval '(gallop-bench-attacks:main)'
;;;;
;;;; Each attack runs against a fresh server process of each kind: native
;;;; (GALLOP:START), gallop (GALLOP:EASY-ACCEPTOR), stock (Hunchentoot's own,
;;;; for comparison) and, where it has the same thing to do, Debian's nginx.
;;;; Servers are bench/server.lisp with its defaults (1 GiB heap, 100
;;;; threads); only their timeouts are raised where said, so that the
;;;; attack's connections stay for the whole measurement.
;;;;
;;;;   silent   ATTACK_SILENT (12,000) connections that send nothing and
;;;;            ATTACK_SLOWLORIS (3,000) that send part of a head, then a
;;;;            header line every 10 s, held open (timeouts 120 s; nginx:
;;;;            client_header_timeout 120 s, worker_connections 20,000).
;;;;            Meanwhile ATTACK_PROBES (50) fresh GET /yo, one a second.
;;;;            Bar: every probe answered exactly, median under 50 ms.
;;;;   errors   wrk -c100 for ATTACK_ERROR_SECONDS (5) on /yo, then as long
;;;;            on /error, a handler that signals an error, three rounds, with
;;;;            the message log on (to a file).  Bar: /error's median rate at
;;;;            least half of /yo's, at most 8 KiB of log per error.  (nginx:
;;;;            no handler.)
;;;;   hangups  ATTACK_HANGUP_ROUNDS (3) rounds of 100 clients that each send
;;;;            POST /upload with Content-Length 100,000 and 1,000 octets of
;;;;            body, wait 3 s and close (the handler reads the body as a
;;;;            stream).  RSS after a full GC, before and after.  Bar: within
;;;;            32 MiB of before, the server alive and answering.  (nginx: no
;;;;            handler.)
;;;;   slowbody slowhttptest -B (R-U-Dead-Yet) against POST /upload, once per
;;;;            count in ATTACK_SLOWBODY ("1000,4000"): -c that many
;;;;            connections opened at 500 a second, each declaring a
;;;;            100,000-octet body and sending a few octets every 5 s.
;;;;            slowhttptest opens its connections once and ends when none
;;;;            is left; it is started again at once, for
;;;;            ATTACK_SLOWBODY_SECONDS (60) in all, so that the attack goes
;;;;            on; the probes start after its first 2 s.
;;;;            Default timeouts (nginx: client_body_timeout 20 s, and /upload
;;;;            discards the body).  Bar: every probe answered, median under
;;;;            50 ms, workers at most the CPUs plus 2, RSS within the body
;;;;            budget (an eighth of the heap) of its value at rest.
;;;;   uploads  8 curl clients at once POST 50 MiB each to /upload (4 with
;;;;            Content-Length, 4 chunked), at most 10 MB/s each, beside 5
;;;;            probes.  Bar: every upload answered with its length, every
;;;;            probe answered, RSS at most 32 MiB above its value at rest.
;;;;   tls-idle 10,000 TLS connections (stock: 150), each with a handshake and
;;;;            one GET /yo, left idle, then closed: bench/tls-hold.lisp's
;;;;            idle part, against servers answering HTTPS only (no probes).
;;;;            Bar: every connection held, RSS after a full GC once they
;;;;            closed within 20 MiB of before.  (nginx: not run.)
;;;;   readers  ATTACK_READERS (300) clients ask for /stream, 1 MiB streamed in
;;;;            16 KiB writes, and never read, for ATTACK_READER_SECONDS
;;;;            (60), beside the probes (one a second).  Default timeouts;
;;;;            Gallop's kinds also without the minimum data rate, as the
;;;;            control ("readers, no rate": the write timeout alone).  Bar:
;;;;            every client ended by the server, the last sooner than in the
;;;;            control (or the control still held some at the end), the log's lines about them at most one a
;;;;            minute.  (Past 100 such clients every worker waits for one,
;;;;            and a probe queued behind their requests waits too: the
;;;;            probes are shown, not part of the bar.)  (nginx: no handler.)
;;;; A monitor samples the server's RSS and threads (nginx: master and
;;;; workers summed) every 250 ms, and Gallop's pool (GALLOP:STATS :THREADS,
;;;; the workers) every second.  Prints one Markdown table; exits 1 when a
;;;; Gallop row misses its bar, 2 when the harness broke.  Traffic goes to
;;;; 127.0.0.1 only; each attack is bounded in time.
;;;;
;;;; Environment: ATTACK_KINDS ("native,gallop,stock,nginx"), ATTACK_CASES
;;;; ("silent,errors,hangups,slowbody,uploads,tls-idle,readers"), the counts above,
;;;; ATTACK_PORT (18520).

(load (merge-pathnames "process.lisp" (or *load-truename* *default-pathname-defaults*)))
(load (merge-pathnames "sockets.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-bench-attacks
  (:use #:common-lisp #:gallop-bench-process #:gallop-bench-sockets)
  (:export #:main))
(in-package #:gallop-bench-attacks)

(defun env-list (name default)
  (let ((v (env name)))
    (if v (remove "" (uiop:split-string v :separator ",") :test #'string=) default)))

(defparameter *kinds* (env-list "ATTACK_KINDS" '("native" "gallop" "stock" "nginx")))
(defparameter *cases* (env-list "ATTACK_CASES" '("silent" "errors" "hangups" "slowbody" "uploads"
                                                 "tls-idle" "readers")))
(defparameter *readers* (env-int "ATTACK_READERS" 300))
(defparameter *reader-seconds* (env-int "ATTACK_READER_SECONDS" 60))
(defparameter *slowbody* (mapcar #'parse-integer (env-list "ATTACK_SLOWBODY" '("1000" "4000"))))
(defparameter *slowbody-seconds* (env-int "ATTACK_SLOWBODY_SECONDS" 60))
(defparameter *silent* (env-int "ATTACK_SILENT" 12000))
(defparameter *slowloris* (env-int "ATTACK_SLOWLORIS" 3000))
(defparameter *probes* (env-int "ATTACK_PROBES" 50))
(defparameter *error-seconds* (env-int "ATTACK_ERROR_SECONDS" 5))
(defparameter *hangup-rounds* (env-int "ATTACK_HANGUP_ROUNDS" 3))
(defparameter *port* (env-int "ATTACK_PORT" 18520))
(defparameter *goal-ms* 50 "A probe's median must be under this.")
(defparameter *logs* (merge-pathnames "bench/results/tmp/attacks/" *repo*))

(defun gallop-kind-p (kind) (member kind '("native" "gallop") :test #'string=))

(defun median (list)
  (if list (nth (floor (length list) 2) (sort (copy-list list) #'<)) 0))

;;; The server under attack: a bench/server.lisp child, or nginx

(defstruct target kind process pid port log)

(defun nginx-conf (dir port)
  (format nil "worker_processes 1;
worker_rlimit_nofile 20000;
daemon off;
error_log ~Aerror.log;
pid ~Anginx.pid;
events { worker_connections 20000; }
http {
  access_log off;
  client_body_temp_path ~Abody;
  proxy_temp_path ~Aproxy;
  fastcgi_temp_path ~Afastcgi;
  uwsgi_temp_path ~Auwsgi;
  scgi_temp_path ~Ascgi;
  client_header_timeout 120s;
  keepalive_timeout 120s;
  server {
    listen 127.0.0.1:~D;
    default_type text/plain;
    location = /yo { return 200 \"Hey!\"; }
    location = /upload { client_body_timeout 20s; return 200 \"ok\"; }
  }
}
" dir dir dir dir dir dir dir port))

(defun start-target (kind port environment &key tls)
  (let ((log (merge-pathnames (format nil "~A.log" kind) *logs*)))
    (if (string= kind "nginx")
        (let* ((dir (namestring (merge-pathnames "nginx/" *logs*)))
               (conf (concatenate 'string dir "nginx.conf")))
          (ensure-directories-exist dir)
          (with-open-file (out conf :direction :output :if-exists :supersede)
            (write-string (nginx-conf dir port) out))
          (let ((process (sb-ext:run-program "nginx" (list "-p" dir "-e" (concatenate 'string dir "error.log")
                                                           "-c" conf)
                                             :search t :wait nil :output nil :error nil)))
            (loop repeat 100 until (probe-yo port) do (sleep 0.1))
            (make-target :kind kind :process process :pid (sb-ext:process-pid process)
                         :port port :log log)))
        (multiple-value-bind (process pid)
            (start-bench-server kind port :environment environment :log log
                                          :if-log-exists :supersede)
          (unless tls (probe-yo port))    ; the first request compiles dispatch
          (make-target :kind kind :process process :pid pid :port port :log log)))))

(defun stop-target (target)
  (kill-and-reap (target-process target)))

(defun children (pid)
  (let ((text (ignore-errors (uiop:read-file-string (format nil "/proc/~D/task/~D/children" pid pid)))))
    (and text (mapcar #'parse-integer (uiop:split-string (string-trim " " text))))))

(defun tree-status (pid)
  "VmRSS (KiB) and threads of PID and its children, summed."
  (let ((rss 0) (threads 0))
    (dolist (p (cons pid (children pid)) (values rss threads))
      (multiple-value-bind (r th) (proc-status p)
        (incf rss (or r 0))
        (incf threads (or th 0))))))

(defun server-gc-rss (target)
  "A full GC in the server, then its RSS in MiB."
  (sb-thread:with-mutex (*ask-lock*)
    (ask-process (target-process target) "gc" "GC " 60))
  (round (or (proc-status (target-pid target)) 0) 1024))

(defun log-size (target)
  (or (ignore-errors (with-open-file (in (target-log target)) (file-length in))) 0))

;;; Watching: peaks of the server, and a fresh client once a second

(defstruct watch (peak-rss 0) (peak-threads 0) (peak-workers 0) (latencies '()) (failures 0)
  (done nil))

(defvar *ask-lock* (sb-thread:make-mutex :name "ask")
  "One question to the server at a time: the monitor's and the harness's.")

(defun server-workers (target)
  "Gallop's pool threads now (GALLOP:STATS :THREADS), or NIL for other kinds."
  (when (gallop-kind-p (target-kind target))
    (let ((line (sb-thread:with-mutex (*ask-lock*)
                  (ask-process (target-process target) "stats" "STATS " 5))))
      (and line (getf (let ((*read-eval* nil)) (ignore-errors (read-from-string line)))
                      :threads)))))

(defun start-watch (target &key (probes 0))
  "Sample TARGET every 250 ms; with PROBES, ask /yo once a second that many
times.  Returns the watch and a function that waits for the probes, stops
sampling and returns the watch."
  (let* ((w (make-watch))
         (lock (sb-thread:make-mutex))
         (monitor (sb-thread:make-thread
                   (lambda ()
                     (loop for tick from 0
                           until (watch-done w)
                           do (multiple-value-bind (rss threads) (tree-status (target-pid target))
                                (setf (watch-peak-rss w) (max (watch-peak-rss w) rss)
                                      (watch-peak-threads w) (max (watch-peak-threads w) threads)))
                              (when (zerop (mod tick 4))
                                (let ((workers (server-workers target)))
                                  (when workers
                                    (setf (watch-peak-workers w)
                                          (max (watch-peak-workers w) workers)))))
                              (sleep 0.25)))))
         (prober (and (plusp probes)
                      (sb-thread:make-thread
                       (lambda ()
                         (dotimes (i probes)
                           (let ((start (get-internal-real-time))
                                 (ms (probe-yo (target-port target))))
                             (sb-thread:with-mutex (lock)
                               (if ms (push ms (watch-latencies w)) (incf (watch-failures w))))
                             (let ((left (- 1 (/ (- (get-internal-real-time) start)
                                                 internal-time-units-per-second))))
                               (when (plusp left) (sleep left))))))))))
    (values w (lambda ()
                (when prober (sb-thread:join-thread prober))
                (setf (watch-done w) t)
                (sb-thread:join-thread monitor)
                w))))

(defun row (target attack w &rest more)
  (list* :kind (target-kind target) :attack attack
         :probes (+ (length (watch-latencies w)) (watch-failures w))
         :answered (length (watch-latencies w))
         :median-ms (median (watch-latencies w))
         :max-ms (reduce #'max (watch-latencies w) :initial-value 0)
         :peak-threads (watch-peak-threads w)
         :peak-rss-mb (round (watch-peak-rss w) 1024)
         ;; Alive, and a fresh GET /yo answered exactly.
         :alive (and (alive-p (target-process target))
                     (or (getf more :https) (probe-yo (target-port target)))
                     t)
         more))

;;; silent: connections that send nothing or part of a head

(defparameter *slowloris-head* (ascii (format nil "GET /yo HTTP/1.1~C~CHost: b~C~C"
                                              #\Return #\Linefeed #\Return #\Linefeed)))
(defparameter *slowloris-line* (ascii (format nil "X-a: b~C~C" #\Return #\Linefeed)))

(defun open-many (port count)
  "COUNT non-blocking connections to PORT (connecting); their fds."
  (let ((address (loopback-address port)))
    (loop repeat count
          for fd = (open-socket address)
          while fd
          collect fd)))

(defun connected-p (fd)
  "True if FD connected and the server has neither closed it nor answered."
  (let ((r (aref (poll-fds (vector fd) (vector (logior +pollin+ +pollout+)) 0) 0)))
    (and (logtest r +pollout+) (not (logtest r (logior +pollin+ +pollerr+ +pollhup+)))
         (zerop (socket-error fd)))))

(defun attack-silent (target)
  (let* ((port (target-port target))
         (silent (open-many port *silent*))
         (slow (open-many port *slowloris*)))
    (unwind-protect
         (progn
           ;; Until every connection completed (a full accept queue makes
           ;; the kernel retry a SYN after 1, 3, 7 s), at most 30 s.
           (loop repeat 30
                 until (every #'connected-p (append silent slow))
                 do (sleep 1))
           (let ((started (make-hash-table)))
             (flet ((keep-sending ()
                      ;; The head first, then a header line each time:
                      ;; a connection that completed late gets its head now.
                      (dolist (fd slow)
                        (when (connected-p fd)
                          (let ((octets (if (gethash fd started) *slowloris-line* *slowloris-head*)))
                            (send-some fd octets 0 (length octets))
                            (setf (gethash fd started) t))))))
               (keep-sending)
               (multiple-value-bind (w finish) (start-watch target :probes *probes*)
                 (loop repeat (ceiling *probes* 10)
                       do (sleep 10)
                          (keep-sending))
                 (funcall finish)
                 (row target "silent" w
                      :load (format nil "~D silent + ~D slowloris" *silent* *slowloris*)
                      :notes (format nil "held at the end: ~D + ~D"
                                     (count-if #'connected-p silent)
                                     (count-if #'connected-p slow)))))))
      (mapc #'%close silent)
      (mapc #'%close slow))))

;;; errors: a handler that signals an error

(defun wrk (port path seconds)
  "Run wrk -t1 -c100 on PATH: requests done, requests a second, non-2xx."
  (let* ((out (uiop:run-program (list "wrk" "-t1" "-c100" (format nil "-d~Ds" seconds)
                                      (format nil "http://127.0.0.1:~D~A" port path))
                                :output :string :ignore-error-status t))
         (done (number-near out " requests in"))
         (rate (number-near out "Requests/sec:" :after t))
         (bad (or (number-near out "Non-2xx or 3xx responses:" :after t) 0)))
    (values (or done 0) (or rate 0) bad)))

(defun number-near (text marker &key after)
  "The number just before MARKER in TEXT (AFTER: just after it), or NIL."
  (let ((at (search marker text)))
    (when at
      (if after
          (let ((*read-eval* nil))
            (ignore-errors (read-from-string text t nil :start (+ at (length marker)))))
          (let* ((line-start (1+ (or (position #\Newline text :end at :from-end t) -1))))
            (ignore-errors (parse-integer (string-trim " " (subseq text line-start at)))))))))

(defparameter *error-rounds* 3
  "Rounds of /yo then /error, each ATTACK_ERROR_SECONDS long: the ratio is of
the medians, so that the host's drift within the run counts for little.")

(defun attack-errors (target)
  (let ((port (target-port target))
        (ok-rates '()) (rates '()) (done 0) (bad 0) (log-bytes 0))
    (multiple-value-bind (w finish) (start-watch target)
      (dotimes (round *error-rounds*)
        (push (nth-value 1 (wrk port "/yo" *error-seconds*)) ok-rates)
        (let ((log-before (log-size target)))
          (multiple-value-bind (n rate non-2xx) (wrk port "/error" *error-seconds*)
            (incf done n)
            (incf bad non-2xx)
            (incf log-bytes (- (log-size target) log-before))
            (push rate rates))))
      (funcall finish)
      (let ((ratio (if (plusp (median ok-rates)) (/ (median rates) (median ok-rates)) 0))
            (per-error (if (plusp bad) (round log-bytes bad) 0)))
        (row target "errors" w
             :load (format nil "wrk -c100, ~D x ~D s on each" *error-rounds* *error-seconds*)
             :rate-ratio ratio
             :log-per-error per-error
             :notes (format nil "/error ~D requests (~D not 2xx), ~,2F of /yo's rate (medians); ~
                                 log ~D B per error"
                            done bad ratio per-error))))))

;;; hangups: clients that send part of a body and close

(defun hangup-round (port clients)
  (let* ((head (ascii (format nil "POST /upload HTTP/1.1~C~CHost: b~C~CContent-Length: 100000~C~C~C~C"
                              #\Return #\Linefeed #\Return #\Linefeed
                              #\Return #\Linefeed #\Return #\Linefeed)))
         (body (make-array 1000 :element-type '(unsigned-byte 8) :initial-element 97))
         (fds (open-many port clients)))
    (sleep 0.5)
    (dolist (fd fds)
      (send-some fd head 0 (length head))
      (send-some fd body 0 (length body)))
    (sleep 3)
    (mapc #'%close fds)))

(defun attack-hangups (target)
  (let ((before (server-gc-rss target))
        (log-before (log-size target)))
    (multiple-value-bind (w finish) (start-watch target)
      (dotimes (i *hangup-rounds*)
        (hangup-round (target-port target) 100))
      (sleep 1)
      (funcall finish)
      (let ((after (server-gc-rss target)))
        (row target "hangups" w
             :load (format nil "~D x 100 clients" *hangup-rounds*)
             :rss-rise-mb (- after before)
             :notes (format nil "RSS after GC ~D -> ~D MiB; log +~D B"
                            before after (- (log-size target) log-before)))))))

;;; slowbody: slowhttptest -B

(defun cpu-count ()
  (parse-integer (string-trim '(#\Newline #\Space)
                              (uiop:run-program '("nproc") :output :string))))

(defun slowhttptest-loop (port connections out deadline)
  "Run slowhttptest -B against PORT's /upload, again each time it ends, until
DEADLINE (internal real time); how many times it ran.  Its output goes to
OUT."
  (let ((runs 0))
    (loop for left = (floor (- deadline (get-internal-real-time)) internal-time-units-per-second)
          while (> left 2)
          do (incf runs)
             (sb-ext:run-program
              "slowhttptest"
              (list "-B" "-c" (princ-to-string connections) "-i" "5" "-s" "100000"
                    "-r" "500" "-l" (princ-to-string left) "-t" "POST"
                    "-u" (format nil "http://127.0.0.1:~D/upload" port))
              :search t :wait t :output (namestring out) :if-output-exists :append
              :error :output))
    runs))

(defun attack-slowbody (target connections)
  (let* ((port (target-port target))
         (rest-rss (round (tree-status (target-pid target)) 1024))
         (out (merge-pathnames (format nil "slowbody-~A-~D.txt" (target-kind target) connections)
                               *logs*))
         (deadline (+ (get-internal-real-time) (* *slowbody-seconds* internal-time-units-per-second)))
         (runs (list 0))
         (attacker (progn
                     (ignore-errors (delete-file out))
                     (sb-thread:make-thread
                      (lambda () (setf (car runs) (slowhttptest-loop port connections out deadline)))
                      :name "slowhttptest"))))
    (sleep 2)
    (multiple-value-bind (w finish) (start-watch target :probes *probes*)
      (funcall finish)
      (sb-thread:join-thread attacker :default nil)
      (row target "slowbody" w
           :load (format nil "slowhttptest -B -c~D" connections)
           :rest-rss-mb rest-rss
           :peak-workers (watch-peak-workers w)
           :notes (format nil "slowhttptest run ~D times; RSS at rest ~D MiB~
                               ~:[~;, workers at most ~:*~D~]"
                          (car runs) rest-rss
                          (and (gallop-kind-p (target-kind target)) (watch-peak-workers w)))))))

;;; uploads: large bodies at once

(defparameter *upload-bytes* (* 50 1024 1024))

(defun upload-file ()
  "A file of *UPLOAD-BYTES* octets of every value, made once."
  (let ((path (merge-pathnames "upload.bin" *logs*)))
    (unless (and (probe-file path)
                 (= *upload-bytes* (with-open-file (in path :element-type '(unsigned-byte 8))
                                     (file-length in))))
      (with-open-file (out path :direction :output :element-type '(unsigned-byte 8)
                                :if-exists :supersede)
        (let ((block (make-array 65536 :element-type '(unsigned-byte 8))))
          (dotimes (i (length block)) (setf (aref block i) (mod (* i 7) 251)))
          (loop repeat (floor *upload-bytes* (length block)) do (write-sequence block out)))))
    path))

(defun attack-uploads (target)
  (let* ((port (target-port target))
         (file (namestring (upload-file)))
         (rest-rss (progn (when (gallop-kind-p (target-kind target)) (server-gc-rss target))
                          (round (tree-status (target-pid target)) 1024)))
         (answers (make-array 8 :initial-element nil))
         (threads (loop for i below 8
                        collect (let ((i i))
                                  (sb-thread:make-thread
                                   (lambda ()
                                     (setf (aref answers i)
                                           (uiop:run-program
                                            (append (list "curl" "-s" "--max-time" "60"
                                                          "--limit-rate" "10M"
                                                          "-H" "Content-Type: application/octet-stream"
                                                          "--data-binary" (concatenate 'string "@" file))
                                                    (when (oddp i)
                                                      (list "-H" "Transfer-Encoding: chunked"))
                                                    (list (format nil "http://127.0.0.1:~D/upload" port)))
                                            :output :string :ignore-error-status t)))
                                   :name "upload")))))
    (multiple-value-bind (w finish) (start-watch target :probes 5)
      (mapc #'sb-thread:join-thread threads)
      (funcall finish)
      (let ((right (count (princ-to-string *upload-bytes*) answers :test #'equal)))
        (row target "uploads" w
             :load "8 x 50 MiB, 4 chunked"
             :rest-rss-mb rest-rss
             :uploads-answered right
             :notes (format nil "~D of 8 answered exactly; RSS at rest ~D MiB" right rest-rss))))))

;;; tls-idle: idle TLS connections, then closed (bench/tls-hold.lisp)

(defun tls-environment ()
  "The environment of a server answering HTTPS only, with a certificate made
for the run (loads bench/tls-hold.lisp, and cl+ssl, once)."
  (unless (find-package "GALLOP-BENCH-TLS-HOLD")
    (load (merge-pathnames "bench/tls-hold.lisp" *repo*)))
  (destructuring-bind (cert key) (make-tls-certificate (merge-pathnames "tls/" *logs*))
    (funcall (find-symbol "SERVER-ENVIRONMENT" "GALLOP-BENCH-TLS-HOLD") cert key)))

(defun attack-tls-idle (target)
  (multiple-value-bind (w finish) (start-watch target)
    (let ((idle (let ((*standard-output* (make-broadcast-stream)))
                  (funcall (find-symbol "RUN-IDLE" "GALLOP-BENCH-TLS-HOLD")
                           (target-kind target) (target-process target) (target-pid target)
                           (target-port target)))))
      (funcall finish)
      (flet ((mib (key) (round (or (getf idle key) 0))))
        (row target "tls-idle" w
             :load (format nil "~:D idle TLS connections" (getf idle :asked))
             :https t
             :tls-held (getf idle :held) :tls-asked (getf idle :asked)
             :rss-kept-mb (- (mib :rss-closed-mib) (mib :rss-before-mib))
             :notes (format nil "~:D held; RSS ~D MiB before, ~D with them, ~D once closed"
                            (getf idle :held) (mib :rss-before-mib) (mib :rss-after-mib)
                            (mib :rss-closed-mib)))))))

;;; readers: streamed answers nobody reads

(defparameter *stream-request* (ascii (format nil "GET /stream HTTP/1.1~C~CHost: b~C~C~C~C"
                                              #\Return #\Linefeed #\Return #\Linefeed
                                              #\Return #\Linefeed)))

(defun attack-readers (target &optional (attack "readers"))
  (let* ((port (target-port target))
         (log-before (log-size target))
         (fds (open-many port *readers*))
         (closed-at (make-hash-table))
         (start (get-internal-real-time)))
    (unwind-protect
         (progn
           (loop repeat 30 until (every #'connected-p fds) do (sleep 0.1))
           (dolist (fd fds)
             (send-some fd *stream-request* 0 (length *stream-request*)))
           (multiple-value-bind (w finish)
               (start-watch target :probes (min *probes* (- *reader-seconds* 2)))
             ;; When the server ends each connection (a reset, or its end
             ;; of file after the part of the answer the socket took).
             (loop while (< (- (get-internal-real-time) start)
                            (* *reader-seconds* internal-time-units-per-second))
                   do (dolist (fd fds)
                        (unless (gethash fd closed-at)
                          (let ((r (aref (poll-fds (vector fd) (vector +pollin+) 0) 0)))
                            (when (logtest r (logior +pollerr+ +pollhup+))
                              (setf (gethash fd closed-at)
                                    (/ (- (get-internal-real-time) start)
                                       internal-time-units-per-second))))))
                      (sleep 0.5))
             (funcall finish)
             (let* ((times (loop for v being the hash-values of closed-at collect v))
                    (held (- (length fds) (length times)))
                    (lines (count-log-lines target log-before)))
               (row target attack w
                    :load (format nil "~D clients reading nothing of /stream" (length fds))
                    :held held
                    :last-close (if times (reduce #'max times) 0)
                    :log-lines lines
                    :notes (format nil "ended by the server: ~D, the last after ~,1F s~
                                        ~:[~;; ~:*~D held at the end~]; log: ~D line~:P"
                                   (length times) (if times (reduce #'max times) 0)
                                   (and (plusp held) held) lines)))))
      (mapc #'%close fds))))

(defun count-log-lines (target from)
  "Lines the server logged past octet FROM of its log."
  (or (ignore-errors
       (with-open-file (in (target-log target) :element-type '(unsigned-byte 8))
         (file-position in from)
         (loop for b = (read-byte in nil) while b count (= b 10))))
      0))

;;; The table

(defun run-case (kind case port &optional count)
  (let ((environment (append (list "BENCH_MESSAGE_LOG=1")
                             (when (string= case "silent") (list "BENCH_TIMEOUT=120"))
                             (when (string= case "readers, no rate")
                               (list "BENCH_GALLOP_OPTIONS=(:min-data-rate cl:nil)"))
                             (sb-ext:posix-environ)))
        (target nil))
    (unwind-protect
         (progn
           (setf target (if (string= case "tls-idle")
                            (unless (string= kind "nginx")
                              (start-target kind port (append (list "BENCH_MESSAGE_LOG=1")
                                                              (tls-environment))
                                            :tls t))
                            (start-target kind port environment)))
           (cond ((string= case "silent") (attack-silent target))
                 ((string= case "slowbody") (attack-slowbody target count))
                 ((string= kind "nginx") nil) ; no handler to attack
                 ((string= case "errors") (attack-errors target))
                 ((string= case "hangups") (attack-hangups target))
                 ((string= case "uploads") (attack-uploads target))
                 ((string= case "tls-idle") (attack-tls-idle target))
                 ((string= case "readers") (attack-readers target))
                 ((string= case "readers, no rate") (attack-readers target case))))
      (when target (stop-target target)))))

(defun bar-missed (row &optional control)
  "Why a Gallop ROW misses the attack's bar, or NIL.  CONTROL: the row of the
same server's control run, for attacks that have one."
  (let ((attack (getf row :attack)))
    (cond ((not (getf row :alive)) "the server died or stopped answering")
          ((and (string= attack "silent")
                (or (/= (getf row :answered) (getf row :probes))
                    (>= (getf row :median-ms) *goal-ms*)))
           "a probe failed or the median was too slow")
          ((and (string= attack "errors")
                (or (< (getf row :rate-ratio) 1/2) (> (getf row :log-per-error) 8192)))
           "errors were too slow or logged too much")
          ((and (string= attack "hangups") (> (getf row :rss-rise-mb) 32))
           "RSS rose more than 32 MiB")
          ((and (string= attack "slowbody")
                (or (/= (getf row :answered) (getf row :probes))
                    (>= (getf row :median-ms) *goal-ms*)))
           "a probe failed or the median was too slow")
          ((and (string= attack "slowbody") (> (getf row :peak-workers) (+ 2 (cpu-count))))
           "more workers than the CPUs plus 2")
          ((and (string= attack "slowbody")
                (> (- (getf row :peak-rss-mb) (getf row :rest-rss-mb)) 128))
           "RSS rose past the body budget")
          ((and (string= attack "uploads")
                (or (/= 8 (getf row :uploads-answered))
                    (/= (getf row :answered) (getf row :probes))))
           "an upload or a probe was not answered")
          ((and (string= attack "uploads")
                (> (- (getf row :peak-rss-mb) (getf row :rest-rss-mb)) 32))
           "RSS rose more than 32 MiB")
          ((and (string= attack "tls-idle")
                (or (/= (getf row :tls-held) (getf row :tls-asked))
                    (> (getf row :rss-kept-mb) 20)))
           "an idle TLS connection was refused, or RSS stayed 20 MiB up once they closed")
          ((and (string= attack "readers")
                (or (plusp (getf row :held))
                    (null control)
                    ;; The control still held some at the end: it took
                    ;; longer than the whole run.
                    (and (zerop (getf control :held))
                         (>= (getf row :last-close) (getf control :last-close)))))
           "clients that read nothing were not ended sooner than in the control")
          ((and (string= attack "readers") (> (getf row :log-lines) 2))
           "more than a log line a minute about them"))))

(defun print-row (row)
  (format t "| ~A | ~A | ~A | ~D/~D | ~D | ~D | ~D | ~D | ~:[no~;yes~] | ~A |~%"
          (getf row :attack) (getf row :kind) (getf row :load)
          (getf row :answered) (getf row :probes) (getf row :median-ms) (getf row :max-ms)
          (getf row :peak-threads) (getf row :peak-rss-mb) (getf row :alive)
          (getf row :notes))
  (finish-output))

(defun main ()
  (handler-case
      (progn
        (raise-fd-limit)
        (ensure-directories-exist *logs*)
        (format t "| attack | server | load | probes answered | median ms | max ms | peak threads | peak RSS MiB | answering at the end | notes |~%")
        (format t "|---|---|---|--:|--:|--:|--:|--:|---|---|~%")
        (let ((missed '()))
          (dolist (case *cases*)
            (dolist (count (if (string= case "slowbody") *slowbody* '(nil)))
              (loop for kind in *kinds*
                    for port from *port*
                    do (let* ((control (and (string= case "readers") (gallop-kind-p kind)
                                            (run-case kind "readers, no rate" port)))
                              (row (run-case kind case port count)))
                         (when control
                           (print-row control))
                         (when row
                           (print-row row)
                           (let ((why (and (gallop-kind-p kind) (bar-missed row control))))
                             (when why (push (format nil "~A ~A: ~A" case kind why) missed))))))))
          (format t "~%~:[Every Gallop row held its bar.~;~:*~{~A~%~}~]~%" (reverse missed))
          (uiop:quit (if missed 1 0))))
    (error (e)
      (format *error-output* "~&bench-attacks: ~A~%" e)
      (uiop:quit 2))))
