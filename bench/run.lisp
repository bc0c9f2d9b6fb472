;;;; run.lisp -- the benchmark harness behind `make bench`, `make bench-quick`,
;;;; `make bench-smoke`, `make bench-tls` and `make bench-processes`.
;;;;
;;;;   scripts/lisp.sh --load bench/run.lisp --eval '(gallop-bench:main :full)'   ; or :quick, :smoke, :tls, :processes
;;;;
;;;; For each repetition and each setup (below) it starts the servers
;;;; (bench/server.lisp for stock Hunchentoot and Gallop's three front ends,
;;;; plus Debian's nginx), each in its own process on 127.0.0.1, runs wrk
;;;; against every scenario of seed 001's matrix -- handler sleep 0 and 1 ms x
;;;; keep-alive and `Connection: close` x 10, 100 and 400 connections --
;;;; rotating the server order from scenario to scenario, then (pinned setup)
;;;; runs the idle-connections scenario (bench/idle.lisp holds N idle
;;;; keep-alive connections open while wrk -c100 runs).  Every wrk run becomes
;;;; a line of bench/results/RUN.tsv as soon as it is done (wrk's numbers, the
;;;; server's CPU time during the run: cpu_s, and cpu_us_per_req = cpu_s / the
;;;; requests wrk completed, from utime + stime in /proc/PID/stat sampled right
;;;; before and after wrk, nginx's master and workers summed, see "Server CPU
;;;; time" below; and threads_max, the most threads the server had, sampled
;;;; every 100 ms); at the end report.lisp turns the TSV into tables (medians
;;;; over repetitions; CPU µs/req beside req/s): the run's report RUN.md
;;;; beside the TSV (every table), the summary in BENCHMARKS.md (a table per
;;;; setup, a line per scenario) and an SVG chart (chart.lisp).
;;;;
;;;;   mode    reps  wrk run  idle N  warm-up  writes
;;;;   :full     3     5 s    10000    1 s     bench/results/RUN.{tsv,md}, BENCHMARKS.md, BENCHMARKS.svg
;;;;   :quick    1     1 s     1000    1 s     bench/results/tmp/RUN.{tsv,md,svg}
;;;;   :smoke    1     1 s      100    none    bench/results/tmp/RUN.{tsv,md,svg}; three scenarios only
;;;;   :tls      3     5 s        0    1 s     bench/results/RUN.{tsv,md,svg}; four scenarios over HTTPS
;;;;   :processes 5    5 s        0    1 s     bench/results/RUN.{tsv,md}, BENCHMARKS.md's many-processes
;;;;                                           section; the many-processes row (below), shared only
;;;;
;;;; The many-processes row (:processes): each Gallop front end (native,
;;;; gallop) in one process and in two processes on one port, each bound
;;;; with :REUSE-PORT (BENCH_REUSE_PORT=1, see bench/server.lisp), beside
;;;; nginx with as many workers (*PROCESSES-WORKERS*), at 0 ms keep-alive
;;;; c100 and c400 in the shared setup.  A server of several processes is
;;;; measured as one: its CPU time and threads summed over its processes,
;;;; as nginx's over its master and workers.  Its table (PROCESSES-REPORT
;;;; in report.lisp) goes between BENCHMARKS.md's bench-processes markers.
;;;;
;;;; Environment overrides: BENCH_REPS, BENCH_DURATION (s), BENCH_WARMUP (s), BENCH_IDLE_N,
;;;; BENCH_IDLE_STOCK_MAX, BENCH_SERVERS (e.g. "gallop,nginx"), BENCH_PORT
;;;; (base port; servers use PORT+1..PORT+7), BENCH_SETUPS ("pinned,shared",
;;;; the default, or either), BENCH_SERVER_CPUS and BENCH_CLIENT_CPUS (the
;;;; pinned setup's taskset lists, "none" for no pinning), BENCH_WRK_THREADS
;;;; (the pinned setup's), BENCH_MESSAGE_LOG=1 (Lisp servers log errors to
;;;; bench/results/tmp/logs/), BENCH_SCENARIOS (scenario keys, e.g.
;;;; "s0-ka-c10,s0-ka-c100,s0-ka-c400": only those; a full run then draws its
;;;; chart beside its TSV, RUN.svg, and leaves BENCHMARKS.md as it is, and so
;;;; does a :processes run, which then writes into bench/results/tmp/).
;;;; :processes runs the shared setup alone, whatever BENCH_SETUPS says.
;;;;
;;;; The exit code is non-zero when anything failed: a server that does not
;;;; start or stops answering, wrk that cannot run or whose output cannot be
;;;; parsed, a run without a single response.  The report is written anyway.
;;;;
;;;; Two setups, because this machine's two cores are shared by the load
;;;; generator and the server.
;;;;  - Pinned: each side gets its own core.  Servers (all their threads;
;;;;    nginx's master and worker) run under `taskset -c 0`; wrk, the idle
;;;;    helper, curl and this harness under `taskset -c 1`.  wrk runs one thread
;;;;    (-t1) because it owns one core, nginx one worker process for the same
;;;;    reason.  The numbers are one-core server throughput and cost with no
;;;;    competition from the load generator: the cost per core.
;;;;  - Shared: nothing pinned, wrk with a thread per CPU, nginx with a worker
;;;;    per CPU: a server on a real machine, beside the other processes that
;;;;    use it.  Every thread may run on every core, so the server's threads
;;;;    migrate, wake each other across cores and wait for CPUs that wrk holds.
;;;;    Here CPU µs per request and the ratio to nginx in the same setup are
;;;;    what to compare; two more scenarios add a busy loop on one core
;;;;    (HOG-COMMAND), so that another process holds a CPU.
;;;; A result that holds only pinned is not a result.  Each repetition runs
;;;; both setups, so drifts of the machine spread over them.  (CPU-POLICY
;;;; below is the same text for BENCHMARKS.md.)

(load (merge-pathnames "process.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-bench
  (:use #:common-lisp #:gallop-bench-process)
  (:export #:main #:report #:goals-across))
(in-package #:gallop-bench)

(defparameter *bench-dir*
  (make-pathname :name nil :type nil :version nil :defaults (or *load-truename* *default-pathname-defaults*)))

(load (merge-pathnames "chart.lisp" *bench-dir*))
(load (merge-pathnames "report.lisp" *bench-dir*))

;;; Configuration

(defstruct (config (:conc-name cfg-))
  mode reps duration warmup settle idle-n idle-stock-max scenarios servers port
  ;; SETUPS: :PINNED and/or :SHARED (see "Two setups" above); SETUP is the
  ;; one being run, and SERVER-CPUS, CLIENT-CPUS and WRK-THREADS are its
  ;; (APPLY-SETUP), taken from the PINNED-... ones for :PINNED.
  setups setup server-cpus client-cpus wrk-threads
  pinned-server-cpus pinned-client-cpus pinned-wrk-threads (wrk-timeout 2)
  ;; NGINX-WORKERS: nginx's worker_processes when the mode sets it (the
  ;; many-processes row: as many as the Gallop servers have processes);
  ;; NIL: one per CPU nginx may use (NGINX-WORKERS).
  nginx-workers
  run-id out-dir tmp-dir tsv md svg summary)

(defun env-cpus (name default)
  (let ((v (env name)))
    (cond ((null v) default)
          ((string-equal v "none") nil)
          (t v))))

(defun scenario (sleep-ms close-p connections &key hog)
  "A scenario of the matrix; with HOG, a busy loop runs on one CPU beside
the server during the run (shared setup only, see HOG-COMMAND)."
  (list :sleep sleep-ms :close close-p :connections connections :hog hog))

(defun scenario-key (s)
  (format nil "s~D-~:[ka~;close~]-c~D~:[~;-hog~]"
          (getf s :sleep) (getf s :close) (getf s :connections) (getf s :hog)))

(defun scenario-label (s)
  (format nil "sleep ~D ms, ~:[keep-alive~;Connection: close~], ~D conn~:[~;, CPU hog~]"
          (getf s :sleep) (getf s :close) (getf s :connections) (getf s :hog)))

(defun hog-scenarios ()
  "The CPU-hog scenarios: does the pool take a CPU that another process
holds for a blocked handler (0 ms: it must not grow), and does it still grow
when handlers do block beside the hog (1 ms)?"
  (list (scenario 0 nil 100 :hog t) (scenario 1 nil 100 :hog t)))

(defun tls-matrix ()
  "The TLS scenarios (make bench-tls): keep-alive at 10, 100 and 400
connections, and Connection: close at 100, where every request is a new TLS
connection, so a full handshake (wrk resumes no session)."
  (list (scenario 0 nil 10) (scenario 0 nil 100) (scenario 0 nil 400) (scenario 0 t 100)))

(defvar *tls* nil
  "In :TLS mode, the certificate and key files (PEM) every server answers
HTTPS with (MAKE-TLS-CERTIFICATE); NIL: plain HTTP.")

(defun url (port path)
  (format nil "~:[http~;https~]://127.0.0.1:~D~A" *tls* port path))

(defparameter *processes-workers* 2
  "nginx's worker processes in the many-processes row (make bench-processes):
as many as the two-process Gallop servers have processes.")

(defun processes-matrix ()
  "The many-processes row's scenarios (make bench-processes): 0 ms
keep-alive at 100 and 400 connections, where the server, not a handler's
sleep, sets the rate."
  (list (scenario 0 nil 100) (scenario 0 nil 400)))

(defun processes-servers ()
  "The many-processes row's servers: each Gallop front end in one process and
in two on one port (:REUSE-PORT), and nginx with as many workers."
  (list "native" "native-2p" "gallop" "gallop-2p" "nginx"))

(defun full-matrix ()
  (append (loop for sleep in '(0 1)
                append (loop for close in '(nil t)
                             append (loop for connections in '(10 100 400)
                                          collect (scenario sleep close connections))))
          (hog-scenarios)))

(defun cpu-count ()
  (with-open-file (in "/proc/cpuinfo")
    (loop for line = (read-line in nil)
          while line
          count (uiop:string-prefix-p "processor" line))))

(defun scenarios-from-env (scenarios)
  "SCENARIOS, or those of them BENCH_SCENARIOS names (their keys, comma
separated)."
  (let ((keys (env-choices "BENCH_SCENARIOS" "scenario" (mapcar #'scenario-key scenarios) :all)))
    (if (eq keys :all)
        scenarios
        (remove-if-not (lambda (s) (member (scenario-key s) keys :test #'string=))
                       scenarios))))

(defun make-cfg (mode)
  (let* ((pin (>= (cpu-count) 2))
         (run-id (format nil "~A-~(~A~)" (timestamp) mode))
         (results (merge-pathnames "results/" *bench-dir*))
         (tmp (merge-pathnames "tmp/" results))
         ;; Only a run of the whole matrix replaces BENCHMARKS.md's summary
         ;; and chart, and only a run of both many-processes scenarios its
         ;; section.
         (summary (and (member mode '(:full :processes)) (not (env "BENCH_SCENARIOS"))))
         ;; A many-processes run that BENCHMARKS.md does not show is a
         ;; check, not a record.
         (out (if (or (member mode '(:full :tls)) (and (eq mode :processes) summary))
                  results
                  tmp)))
    (multiple-value-bind (reps duration idle-n warmup scenarios)
        (ecase mode
          (:full (values 3 5 10000 1 (full-matrix)))
          (:quick (values 1 1 1000 1 (full-matrix)))
          (:tls (values 3 5 0 1 (tls-matrix)))
          (:processes (values 5 5 0 1 (processes-matrix)))
          (:smoke (values 1 1 100 0 (list (scenario 0 nil 10) (scenario 1 t 100)
                                          (scenario 0 nil 100 :hog t)))))
      (make-config
       :mode mode :run-id run-id
       :reps (env-int "BENCH_REPS" reps)
       :duration (max 1 (env-int "BENCH_DURATION" duration))
       :warmup (env-int "BENCH_WARMUP" warmup)
       ;; Seconds to let a server settle before reading its RSS.
       :settle (if (eq mode :full) 1 0.3)
       :idle-n (env-int "BENCH_IDLE_N" idle-n)
       :idle-stock-max (env-int "BENCH_IDLE_STOCK_MAX" 80)
       :scenarios (scenarios-from-env scenarios)
       :servers (env-choices "BENCH_SERVERS" "server" (mapcar #'first *servers*)
                             (if (eq mode :processes)
                                 (processes-servers)
                                 ;; The matrix: every server of one process.
                                 (loop for (name) in *servers*
                                       when (= (server-process-count name) 1) collect name)))
       :port (env-int "BENCH_PORT" 18080)
       :setups (let ((list (env "BENCH_SETUPS")))
                 (cond
                   ;; The many-processes row is a shared-setup row: pinned,
                   ;; two processes would share one core.
                   ((eq mode :processes) '(:shared))
                   (list
                    (mapcar (lambda (name)
                              (or (find (string-trim " " name) '(:pinned :shared) :test #'string-equal)
                                  (error "BENCH_SETUPS: unknown setup ~S (known: pinned, shared)" name)))
                            (remove "" (split list #\,) :test #'string=)))
                   (pin '(:pinned :shared))
                   (t '(:shared))))
       :pinned-server-cpus (env-cpus "BENCH_SERVER_CPUS" (and pin "0"))
       :pinned-client-cpus (env-cpus "BENCH_CLIENT_CPUS" (and pin "1"))
       :pinned-wrk-threads (max 1 (env-int "BENCH_WRK_THREADS" 1))
       :nginx-workers (and (eq mode :processes) (princ-to-string *processes-workers*))
       :out-dir out :tmp-dir tmp
       :tsv (merge-pathnames (format nil "~A.tsv" run-id) out)
       :md (merge-pathnames (format nil "~A.md" run-id) out)
       ;; The many-processes row has no chart.
       :svg (cond ((eq mode :processes) nil)
                  (summary (merge-pathnames "BENCHMARKS.svg" *repo*))
                  (t (merge-pathnames (format nil "~A.svg" run-id) out)))
       :summary (and summary (merge-pathnames "BENCHMARKS.md" *repo*))))))

(defun apply-setup (cfg setup)
  "Make SETUP the one CFG runs: its CPUs for servers and clients and wrk's
threads.  Pinned: as BENCH_SERVER_CPUS, BENCH_CLIENT_CPUS, BENCH_WRK_THREADS
say (by default server on CPU 0, wrk -t1 on CPU 1).  Shared: nothing pinned,
wrk with a thread per CPU, nginx with a worker per CPU."
  (setf (cfg-setup cfg) setup)
  (ecase setup
    (:pinned (setf (cfg-server-cpus cfg) (cfg-pinned-server-cpus cfg)
                   (cfg-client-cpus cfg) (cfg-pinned-client-cpus cfg)
                   (cfg-wrk-threads cfg) (cfg-pinned-wrk-threads cfg)))
    (:shared (setf (cfg-server-cpus cfg) nil
                   (cfg-client-cpus cfg) nil
                   (cfg-wrk-threads cfg) (cpu-count))))
  cfg)

(defun setup-scenarios (cfg)
  "The scenarios of CFG's setup: the CPU-hog ones only when shared."
  (if (eq (cfg-setup cfg) :shared)
      (cfg-scenarios cfg)
      (remove-if (lambda (s) (getf s :hog)) (cfg-scenarios cfg))))

(defun server-port (cfg name)
  (+ (cfg-port cfg) 1 (position name *servers* :key #'first :test #'string=)))

;;; Running programs

(defvar *live* '() "Processes this harness started and has not reaped.")

(defparameter *idle-batch* 32
  "How many idle connections the helper opens at once: below the listen
backlog of 50 that a stock Hunchentoot acceptor keeps (also with
GALLOP:TASKMASTER), see *BATCH* in idle.lisp.")

(defun pin (cpus program args)
  "PROGRAM and ARGS, under taskset -c CPUS when CPUS."
  (if cpus
      (values "taskset" (list* "-c" cpus program args))
      (values program args)))

(defun shell-quote (arg)
  (if (and (plusp (length arg))
           (every (lambda (c) (or (alphanumericp c) (find c "-_./:=,%+@"))) arg))
      arg
      (format nil "'~A'" (uiop:frob-substrings arg '("'") "'\\''"))))

(defun command-line (program args)
  (format nil "~{~A~^ ~}" (mapcar #'shell-quote (cons program args))))

(defun run-capture (program args)
  "Run PROGRAM to completion; its output (stdout and stderr) and exit code."
  (let* ((out (make-string-output-stream))
         (p (sb-ext:run-program program args :search t :directory (namestring *repo*)
                                             :input nil :output out :error :output :wait t)))
    (values (get-output-stream-string out) (sb-ext:process-exit-code p))))

(defun spawn (program args &key input output error)
  (let ((p (sb-ext:run-program program args :search t :directory (namestring *repo*) :wait nil
                                            :input input :output output :error error
                                            :if-output-exists :append :if-error-exists :append)))
    (push p *live*)
    p))

(defun proc-stat-fields (pid)
  "The fields of /proc/PID/stat after the command name, as strings (the first
is field 3, the state), or NIL when PID is gone.  The name, in parentheses,
may itself hold spaces and parentheses, so the fields start after the last
closing one."
  (let* ((stat (ignore-errors
                (with-open-file (in (format nil "/proc/~D/stat" pid)) (read-line in nil))))
         (close (and stat (position #\) stat :from-end t))))
    (and close (split (string-trim " " (subseq stat (1+ close))) #\Space))))

(defun child-pids (pid)
  "The processes whose parent is PID (from /proc/*/stat)."
  (loop for dir in (directory "/proc/*/" :resolve-symlinks nil)
        for id = (parse-integer (or (car (last (pathname-directory dir))) "") :junk-allowed t)
        for fields = (and id (proc-stat-fields id))
        when (and fields (eql (parse-integer (second fields) :junk-allowed t) pid))
          collect id))

(defun reap (process)
  (ignore-errors (sb-ext:process-close process))
  (setf *live* (remove process *live*)))

(defun kill-process (process &key (grace 5))
  "SIGTERM PROCESS, SIGKILL it (and its children) after GRACE seconds."
  (when (alive-p process)
    (let ((children (child-pids (sb-ext:process-pid process))))
      (ignore-errors (sb-ext:process-kill process 15))
      (unless (wait-exit process grace)
        (dolist (child children) (ignore-errors (sb-unix:unix-kill child 9)))
        (ignore-errors (sb-ext:process-kill process 9))
        (wait-exit process 5))))
  (reap process))

(defun kill-all-live ()
  (dolist (p *live*) (ignore-errors (kill-process p :grace 1))))

(defun send-line (process line)
  (ignore-errors
   (let ((in (sb-ext:process-input process)))
     (write-line line in)
     (finish-output in)
     t)))

(defun tree-status (pid)
  "PROC-STATUS summed over PID and its children (nginx: master and workers)."
  (let ((rss 0) (threads 0) (any nil))
    (dolist (p (cons pid (child-pids pid)))
      (multiple-value-bind (r th) (proc-status p)
        (when r (setf any t) (incf rss r) (incf threads (or th 0)))))
    (if any (values rss threads) (values nil nil))))

;;; Server CPU time.  The TSV's cpu_s is the CPU time the server used during a
;;; wrk run (utime + stime, sampled right before and right after it), and
;;; cpu_us_per_req that time divided by the requests wrk completed: what a
;;; request costs the server, which req/s alone hides when the server is not
;;; the bottleneck (sleep 1 ms, or wrk itself the limit).  It is read from
;;; /proc/PID/stat, not /proc/PID/schedstat: schedstat (ns) counts only the
;;; thread PID names, while the Lisp servers work in pool threads that come and
;;; go, and stat's utime and stime count the whole process, exited threads
;;; included.  Its unit is the clock tick (10 ms at CLK_TCK 100): about 1% of
;;; a 1 s run on a busy core.

(defvar *clock-ticks* nil "Clock ticks per second (getconf CLK_TCK), once known.")

(defun clock-ticks ()
  "Clock ticks per second, the unit of utime and stime in /proc/PID/stat:
`getconf CLK_TCK`, or 100 (Linux's USER_HZ everywhere) if that fails."
  (or *clock-ticks*
      (setf *clock-ticks*
            (let ((n (ignore-errors (parse-integer (run-capture "getconf" '("CLK_TCK"))
                                                   :junk-allowed t))))
              (if (and n (plusp n)) n 100)))))

(defun proc-cpu-ticks (pid)
  "utime + stime of process PID in clock ticks (/proc/PID/stat fields 14 and
15: every thread of the process, exited ones included), or NIL when PID is gone."
  (let ((fields (proc-stat-fields pid)))
    ;; Field N is element N - 3 of FIELDS.
    (let ((utime (and fields (parse-integer (or (nth 11 fields) "") :junk-allowed t)))
          (stime (and fields (parse-integer (or (nth 12 fields) "") :junk-allowed t))))
      (and utime stime (+ utime stime)))))

(defun tree-cpu-ticks (pid)
  "PROC-CPU-TICKS summed over PID and its children (nginx: the master and its
workers), or NIL when PID is gone."
  (let ((own (and pid (proc-cpu-ticks pid))))
    (when own
      (+ own (loop for child in (child-pids pid)
                   sum (or (proc-cpu-ticks child) 0))))))

(defun pids-cpu-ticks (pids)
  "TREE-CPU-TICKS summed over PIDS (the processes of one server), or NIL
when PIDS is empty or any of them is gone."
  (let ((ticks (mapcar #'tree-cpu-ticks pids)))
    (and ticks (notany #'null ticks) (reduce #'+ ticks))))

(defun cpu-seconds (before after)
  "Seconds of CPU between two TREE-CPU-TICKS samples, or NIL when either is
missing or the total went down (a process of the tree ended in between and
took its time with it)."
  (and before after (>= after before)
       (/ (- after before) (clock-ticks))))

(defun nginx-program () (find-program "nginx" "/usr/sbin" "/sbin"))


;;; HTTP check

(defun http-ok-p (port &optional (timeout 3))
  "True when GET /yo on 127.0.0.1:PORT answers 200 with \"Hey...\"."
  (multiple-value-bind (out code)
      (run-capture "curl" (list "-s" "-k" "-m" (princ-to-string timeout) "-w" "\\n%{http_code}"
                                (url port "/yo?name=bench")))
    (and (eql code 0)
         (search "Hey" out)
         (let ((nl (position #\Newline out :from-end t)))
           (and nl (string= (string-trim '(#\Return #\Space) (subseq out (1+ nl))) "200"))))))

(defun port-free-p (port)
  (multiple-value-bind (out code)
      (run-capture "curl" (list "-s" "-m" "1" "-o" "/dev/null" (format nil "http://127.0.0.1:~D/" port)))
    (declare (ignore out))
    (eql code 7)))                      ; 7: could not connect

;;; Servers

;;; A server is one process (nginx: its master), or, for the many-processes
;;; row's servers (SERVER-PROCESS-COUNT above 1), the first of the processes
;;; that serve one port with :REUSE-PORT, the others its PEERS (servers of
;;; one process each).  Its CPU time and threads are summed over all of them
;;; (SERVER-PIDS), and it is usable only while every one of them runs.
(defstruct (server (:conc-name srv-)) name port sleep-ms process pid log dir peers)

(defun server-processes (server)
  "SERVER and its peers: every process that serves its port."
  (cons server (srv-peers server)))

(defun server-pids (server)
  "The pids of every process of SERVER."
  (mapcar #'srv-pid (server-processes server)))

(defun lisp-server-p (server) (string/= (srv-name server) "nginx"))

(defun log-path (cfg name port)
  (merge-pathnames (format nil "logs/~A-~A-~D.log" (cfg-run-id cfg) name port) (cfg-tmp-dir cfg)))

(defun count-cpus (list)
  "How many CPUs a taskset list such as \"0\", \"0,1\" or \"0-3\" names."
  (loop for part in (split list #\,)
        for dash = (position #\- part)
        sum (if dash
                (1+ (- (parse-integer part :start (1+ dash)) (parse-integer part :end dash)))
                1)))

(defun nginx-workers (cfg)
  "nginx's worker_processes: as CFG's mode sets it, else one per core nginx
may use (auto when unpinned)."
  (let ((cpus (cfg-server-cpus cfg)))
    (cond ((cfg-nginx-workers cfg))
          (cpus (princ-to-string (max 1 (count-cpus cpus))))
          (t "auto"))))

(defun nginx-conf (cfg dir port)
  (format nil "# Written by bench/run.lisp for one benchmark run.
# ~:[One worker per core nginx may use (taskset)~;As many workers as the Gallop servers have processes~]; see BENCHMARKS.md.
worker_processes ~A;
worker_rlimit_nofile 20000;
pid ~Anginx.pid;
error_log ~Aerror.log warn;
events {
    # Room for 10000 idle connections plus the load.
    worker_connections 20000;
}
http {
    access_log off;
    keepalive_timeout 75s;
    # Hunchentoot and Gallop never close a busy keep-alive connection; nor does this.
    keepalive_requests 1000000;
    client_body_temp_path ~Abody;
    proxy_temp_path ~Aproxy;
    fastcgi_temp_path ~Afastcgi;
    uwsgi_temp_path ~Auwsgi;
    scgi_temp_path ~Ascgi;
    server {
        listen 127.0.0.1:~A~:[;~; ssl;
        ssl_certificate ~A;
        ssl_certificate_key ~A;
        # nginx 1.22 leaves TLS 1.3 out by default (1.23.4 and later have it);
        # the Lisp servers speak it (OpenSSL's default), so the same protocol.
        ssl_protocols TLSv1.2 TLSv1.3;~]
        location = /yo {
            default_type text/plain;
            return 200 \"Hey!\";
        }
    }
}
" (cfg-nginx-workers cfg) (nginx-workers cfg) dir dir dir dir dir dir dir port
  *tls* (first *tls*) (second *tls*)))

(defun nginx-command (cfg dir)
  (pin (cfg-server-cpus cfg) (or (nginx-program) "nginx")
       (list "-p" dir "-e" (format nil "~Aerror.log" dir)
             "-c" (format nil "~Anginx.conf" dir) "-g" "daemon off;")))

(defun server-command (cfg kind port sleep-ms &key reuse-port)
  "The command of a bench/server.lisp process serving KIND (\"native\",
\"gallop\"...) on PORT; with REUSE-PORT, bound with :REUSE-PORT, so that
several such processes serve PORT."
  (let ((args (list "--load" "bench/server.lisp" "--end-toplevel-options"
                    kind (princ-to-string port) (princ-to-string sleep-ms)))
        ;; bench/server.lisp reads these (see its header): HTTPS, and
        ;; :REUSE-PORT.
        (environment (append (and *tls* (list (format nil "BENCH_TLS_CERT=~A" (first *tls*))
                                              (format nil "BENCH_TLS_KEY=~A" (second *tls*))))
                             (and reuse-port (list "BENCH_REUSE_PORT=1")))))
    (if environment
        (pin (cfg-server-cpus cfg) "env" (append environment (list (lisp-sh)) args))
        (pin (cfg-server-cpus cfg) (lisp-sh) args))))

(defun start-server (cfg name sleep-ms)
  "Start server NAME, all its processes; it is not ready yet (see WAIT-READY)."
  (let* ((port (server-port cfg name))
         (count (server-process-count name))
         (log (namestring (ensure-directories-exist (log-path cfg name port)))))
    (if (string= name "nginx")
        (let ((dir (namestring (merge-pathnames (format nil "nginx-~D/" port) (cfg-tmp-dir cfg)))))
          (ensure-directories-exist dir)
          (write-string-to-file (nginx-conf cfg dir port) (format nil "~Anginx.conf" dir))
          (multiple-value-bind (program args) (nginx-command cfg dir)
            (let ((p (spawn program args :input nil :output log :error log)))
              (make-server :name name :port port :sleep-ms sleep-ms :process p
                           :pid (sb-ext:process-pid p) :log log :dir dir))))
        (flet ((one (log)
                 (multiple-value-bind (program args)
                     (server-command cfg (string-downcase (server-kind name)) port sleep-ms
                                     :reuse-port (> count 1))
                   (let ((p (spawn program args :input :stream :output :stream :error log)))
                     (make-server :name name :port port :sleep-ms sleep-ms :process p
                                  :pid (sb-ext:process-pid p) :log log)))))
          (let ((server (one log)))
            ;; Each further process logs to a file of its own, NAME.2 ...
            (setf (srv-peers server)
                  (loop for i from 2 to count
                        collect (one (namestring
                                      (log-path cfg (format nil "~A.~D" name i) port)))))
            server)))))

(defun wait-ready (server &optional (timeout 60))
  "Wait until SERVER answers GET /yo.  True if it does; else NIL and why.  A
Lisp server gets TIMEOUT seconds to load (and maybe compile) and say READY,
each of its processes (they load at once), then, like nginx, 10 seconds to
answer."
  (when (lisp-server-p server)
    (dolist (part (server-processes server))
      (let* ((p (srv-process part))
             (line (read-line-timeout (sb-ext:process-output p) timeout)))
        (unless (and line (uiop:string-prefix-p "READY " line))
          (return-from wait-ready
            (values nil (if (alive-p p)
                            (format nil "not READY within ~D s" timeout)
                            (format nil "exited (code ~A) before READY"
                                    (sb-ext:process-exit-code p))))))
        (setf (srv-pid part) (parse-integer line :start 6 :junk-allowed t)))))
  (loop with deadline = (+ (get-internal-real-time) (* 10 internal-time-units-per-second))
        do (when (http-ok-p (srv-port server) 2) (return t))
           (let ((gone (find-if-not #'alive-p (server-processes server) :key #'srv-process)))
             (when gone
               (return (values nil (format nil "exited (code ~A)"
                                           (sb-ext:process-exit-code (srv-process gone)))))))
           (when (> (get-internal-real-time) deadline)
             (return (values nil "no 200 answer to GET /yo within 10 s")))
           (sleep 0.1)))

(defun stop-server (server)
  "Stop every process of SERVER and remove its directory (nginx's)."
  (when server
    (when (lisp-server-p server)
      ;; All are told first, so that they exit together.
      (dolist (part (server-processes server))
        (let ((p (srv-process part)))
          (send-line p "quit")
          (ignore-errors (close (sb-ext:process-input p))))))
    (dolist (part (server-processes server))
      (let ((p (srv-process part)))
        (when (lisp-server-p server)
          (wait-exit p 5))
        (kill-process p)))
    (when (srv-dir server)
      (uiop:delete-directory-tree (pathname (srv-dir server))
                                  :validate t :if-does-not-exist :ignore))))

(defun server-stats (server)
  "GALLOP:STATS (or stock Hunchentoot's thread count) of a Lisp server, or NIL."
  (when (and server (lisp-server-p server))
    (ask-stats (srv-process server) 5)))

(defun fmt-stats (plist &optional (keys '(:open :idle :threads :run-permits :shed :rejected :timeouts)))
  (format nil "~{~(~A~)=~A~^ ~}"
          (loop for k in keys
                for v = (getf plist k)
                when v append (list k v))))

(defun server-note (server)
  "FMT-STATS of each process of SERVER, separated by \" | \" (with its
requests served so far when there are several: how the kernel spread the
connections), or NIL for nginx."
  (when (lisp-server-p server)
    (let ((keys (append '(:open :idle :threads :run-permits :shed :rejected :timeouts)
                        (and (srv-peers server) '(:requests)))))
      (format nil "~{~A~^ | ~}"
              (mapcar (lambda (part) (fmt-stats (server-stats part) keys))
                      (server-processes server))))))

(defun server-failure (server)
  "Why SERVER is unusable (any of its processes gone, or no 200 to GET /yo),
or NIL."
  (let ((gone (and server (find-if-not #'alive-p (server-processes server) :key #'srv-process))))
    (cond ((null server) "server did not start")
          (gone
           (format nil "server process exited (code ~A)"
                   (sb-ext:process-exit-code (srv-process gone))))
          ((not (http-ok-p (srv-port server) 5))
           "server did not answer GET /yo with 200"))))

;;; wrk

(defun wrk-report (text)
  "PARSE-WRK of wrk --latency's report TEXT, or NIL when it lacks any of
requests, duration, Requests/sec and the 50% and 99% latencies."
  (let ((r (parse-wrk text)))
    (and (every (lambda (k) (getf r k)) '(:rps :requests :duration :p50 :p99))
         r)))

(defun wrk-args (cfg port connections close-p duration)
  (append (list (format nil "-t~D" (min (cfg-wrk-threads cfg) connections))
                (format nil "-c~D" connections)
                (format nil "-d~Ds" duration)
                "--timeout" (format nil "~Ds" (cfg-wrk-timeout cfg))
                "--latency")
          (when close-p (list "-H" "Connection: close"))
          (list (url port "/yo"))))

(defun hog-command ()
  "A busy loop on the machine's last CPU: another process's work beside the
server (shared setup)."
  (values "taskset" (list "-c" (princ-to-string (1- (cpu-count)))
                          "sh" "-c" "while :; do :; done")))

(defun call-sampling-threads (pids function)
  "Call FUNCTION while a thread samples the thread count of the processes
PIDS (and their children), summed, every 100 ms; FUNCTION's values, then the
most threads seen (NIL without PIDS)."
  (let* ((done nil)
         (most nil)
         (sampler (and pids (sb-thread:make-thread
                             (lambda ()
                               (loop until done
                                     do (let ((n (loop for pid in pids
                                                       for th = (nth-value 1 (tree-status pid))
                                                       when th sum th)))
                                          (when (and (plusp n) (or (null most) (> n most)))
                                            (setf most n)))
                                        (sleep 0.1)))
                             :name "thread sampler"))))
    (let ((values (unwind-protect (multiple-value-list (funcall function))
                    (setf done t)
                    (when sampler (sb-thread:join-thread sampler :default nil)))))
      (values-list (append values (list most))))))

(defun run-wrk (cfg port connections close-p duration &optional server-pids hog)
  "Run wrk (beside a CPU hog when HOG); its parsed report (or NIL), its
output, exit code and command line, the seconds of CPU that the processes
SERVER-PIDS (one server's) and their children used meanwhile (NIL when not
given or not known; see CPU-SECONDS), and the most threads they had
meanwhile."
  (multiple-value-bind (program args)
      (pin (cfg-client-cpus cfg) "wrk" (wrk-args cfg port connections close-p duration))
    (let ((hog-process (and hog (multiple-value-call #'spawn (hog-command)))))
      (unwind-protect
           (call-sampling-threads
            server-pids
            (lambda ()
              ;; The server's CPU is sampled as close to wrk's start and end as
              ;; can be, so that it holds the run and little else.
              (let ((before (pids-cpu-ticks server-pids)))
                (multiple-value-bind (out code)
                    ;; wrk stops by itself after -d; timeout only guards against a hang.
                    (run-capture "timeout" (list* "-k" "5" (princ-to-string (+ duration 30))
                                                  program args))
                  (let ((cpu (and server-pids (cpu-seconds before (pids-cpu-ticks server-pids)))))
                    (values (wrk-report out) out code (command-line program args) cpu))))))
        (when hog-process
          (ignore-errors (sb-ext:process-kill hog-process 9))
          (wait-exit hog-process 5)
          (reap hog-process))))))

(defun last-nonblank-line (text)
  (let ((lines (remove "" (mapcar (lambda (l) (string-trim " " l)) (split text #\Newline))
                       :test #'string=)))
    (car (last lines))))

;;; Rows

(defun new-row (cfg rep scenario-key sleep-ms close-p connections server-name)
  (let ((row (make-hash-table :test #'equal)))
    (setf (gethash "run_id" row) (cfg-run-id cfg)
          (gethash "mode" row) (string-downcase (cfg-mode cfg))
          (gethash "setup" row) (string-downcase (cfg-setup cfg))
          (gethash "rep" row) rep
          (gethash "scenario" row) scenario-key
          (gethash "sleep_ms" row) sleep-ms
          (gethash "connection" row) (if close-p "close" "keep-alive")
          (gethash "connections" row) connections
          (gethash "server" row) server-name
          (gethash "duration_s" row) (cfg-duration cfg)
          (gethash "status" row) "ok")
    row))

(defun fail-row (row reason)
  (setf (gethash "status" row) (format nil "failed: ~A" reason))
  row)

(defun measure (cfg row server)
  "Run wrk for ROW's scenario against SERVER and fill ROW in."
  (let ((failure (and (null server) "server did not start")))
    (when failure (return-from measure (fail-row row failure))))
  (multiple-value-bind (r out code command cpu threads)
      (run-wrk cfg (srv-port server) (gethash "connections" row)
               (string= (gethash "connection" row) "close") (cfg-duration cfg)
               (server-pids server) (hog-scenario-p (gethash "scenario" row)))
    (setf (gethash "command" row) command
          (gethash "threads_max" row) threads)
    (cond ((null r)
           (fail-row row (format nil "wrk exit ~A, unparsable output: ~A" code
                                 (last-nonblank-line out))))
          (t
           (let* ((requests (float (getf r :requests) 1d0))
                  (non2xx (getf r :non2xx)))
             (setf (gethash "requests" row) (round requests)
                   (gethash "rps" row) (getf r :rps)
                   ;; wrk's Requests/sec uses the exact run time; its printed
                   ;; duration is rounded, so scale rather than divide.
                   (gethash "ok_rps" row) (if (plusp requests)
                                              (* (getf r :rps) (/ (- requests non2xx) requests))
                                              0)
                   (gethash "p50_ms" row) (getf r :p50)
                   (gethash "p90_ms" row) (getf r :p90)
                   (gethash "p99_ms" row) (getf r :p99)
                   (gethash "err_connect" row) (round (getf r :connect))
                   (gethash "err_read" row) (round (getf r :read))
                   (gethash "err_write" row) (round (getf r :write))
                   (gethash "err_timeout" row) (round (getf r :timeout))
                   (gethash "non2xx" row) (round non2xx)
                   ;; Per request wrk completed, whatever its status: a 503
                   ;; costs the server CPU too.
                   (gethash "cpu_s" row) cpu
                   (gethash "cpu_us_per_req" row) (and cpu (plusp requests)
                                                       (/ (* cpu 1000000) requests)))
             (when (zerop requests)
               (fail-row row "no response at all")))))
    ;; The server must still answer afterwards.
    (let ((failure (server-failure server)))
      (when failure
        (fail-row row (format nil "after the run: ~A" failure))))
    row))

;;; Progress

(defvar *steps-done* 0)
(defvar *steps-total* 1)

(defun progress-begin (rep cfg what server-name)
  (incf *steps-done*)
  (format t "~&[~3D/~D | ~A elapsed~@[ | ~~~A left~]] rep ~D/~D | ~A | ~A ... "
          *steps-done* *steps-total* (clock (elapsed))
          (and (> *steps-done* 1)
               (clock (* (/ (elapsed) (1- *steps-done*)) (- *steps-total* (1- *steps-done*)))))
          rep (cfg-reps cfg) what (server-label server-name))
  (finish-output))

(defun row-summary (row)
  (if (row-ok-p row)
      (format nil "~A req/s (2xx ~A), ~A CPU µs/req, p99 ~A~:[~;, socket errors ~:*~A~]~:[~;, non-2xx ~:*~A~]"
              (fmt-int (cell row "rps")) (fmt-int (cell row "ok_rps"))
              (fmt-us (cell row "cpu_us_per_req")) (fmt-ms (cell row "p99_ms"))
              (let ((e (+ (or (gethash "err_connect" row) 0) (or (gethash "err_read" row) 0)
                          (or (gethash "err_write" row) 0) (or (gethash "err_timeout" row) 0))))
                (and (plusp e) e))
              (let ((n (gethash "non2xx" row))) (and n (plusp n) n)))
      (gethash "status" row)))

(defun progress-end (text)
  (format t "~A~%" text)
  (finish-output))

;;; The run

(defvar *failures* 0)

(defun record (tsv row)
  (unless (row-ok-p row) (incf *failures*))
  (write-tsv-row tsv row))

(defun rotate (list k)
  (let ((m (mod k (max 1 (length list)))))
    (append (nthcdr m list) (subseq list 0 m))))

(defun start-ready (cfg name sleep-ms)
  "A running, answering server NAME, or NIL and why (its log may say more)."
  (let ((server (start-server cfg name sleep-ms)))
    (multiple-value-bind (ok why) (wait-ready server 60)
      (if ok
          server
          (progn
            (format t "~&!! ~A did not start: ~A; see ~A~%" (server-label name) why
                    (enough-namestring (srv-log server) *repo*))
            (stop-server server)
            (values nil (format nil "server did not start: ~A" why)))))))

(defun warm-up (cfg servers)
  (when (plusp (cfg-warmup cfg))
    (dolist (server servers)
      (when server
        (run-wrk cfg (srv-port server) 10 nil (cfg-warmup cfg))))))

(defun run-matrix-group (cfg tsv rep sleep-ms scenarios)
  "Start every server with handler sleep SLEEP-MS, run SCENARIOS against them
(rotating the server order), stop them."
  (let ((servers '()))
    (unwind-protect
         (progn
           ;; Start them all at once (they load in parallel), then wait for each.
           (let ((started (mapcar (lambda (name) (cons name (start-server cfg name sleep-ms)))
                                  (cfg-servers cfg))))
             (dolist (entry started)
               (let ((server (cdr entry)))
                 (multiple-value-bind (ok why) (wait-ready server 60)
                   (if ok
                       (push (list (car entry) server) servers)
                       (progn
                         (format t "~&!! ~A did not start: ~A; see ~A~%"
                                 (server-label (car entry)) why
                                 (enough-namestring (srv-log server) *repo*))
                         (stop-server server)
                         (push (list (car entry) nil (format nil "server did not start: ~A" why))
                               servers)))))))
           (warm-up cfg (mapcar #'second servers))
           (loop for scenario in scenarios
                 for si from 0
                 do (dolist (name (rotate (cfg-servers cfg) (+ rep si)))
                      ;; ENTRY: (name server-or-nil why-not)
                      (let* ((entry (assoc name servers :test #'string=))
                             (server (second entry))
                             (row (new-row cfg rep (scenario-key scenario) sleep-ms
                                           (getf scenario :close) (getf scenario :connections)
                                           name)))
                        (progress-begin rep cfg (format nil "~(~A~): ~A" (cfg-setup cfg) (scenario-label scenario)) name)
                        (if server
                            (measure cfg row server)
                            (fail-row row (or (third entry) "server did not start")))
                        (when (and server (lisp-server-p server))
                          (setf (gethash "note" row) (server-note server)))
                        (record tsv row)
                        (progress-end (row-summary row))
                        ;; A server that stopped answering gets one restart.
                        (when (and server (server-failure server))
                          (format t "~&!! restarting ~A~%" (server-label name))
                          (stop-server server)
                          (multiple-value-bind (new why) (start-ready cfg name sleep-ms)
                            (setf (second entry) new
                                  (third entry) why)))))))
      (dolist (entry servers) (stop-server (second entry))))))

(defun parse-fields (line)
  "\"HELD held=1 failed=0 ...\" as a plist (:HELD 1 :FAILED 0 ...)."
  (loop for word in (rest (wrk-words line))
        for eq = (position #\= word)
        when eq
          append (list (intern (string-upcase (subseq word 0 eq)) :keyword)
                       (parse-integer word :start (1+ eq) :junk-allowed t))))

(defun run-idle (cfg tsv rep name)
  "The idle-connections scenario for server NAME, on a fresh server."
  (let* ((stock (string= name "stock"))
         (n (if stock (min (cfg-idle-n cfg) (cfg-idle-stock-max cfg)) (cfg-idle-n cfg)))
         (base (new-row cfg rep "idle-base" 0 nil 100 name))
         (row (new-row cfg rep "idle" 0 nil 100 name))
         (notes '())
         (server nil)
         (helper nil))
    (setf (gethash "idle_n" row) n)
    (when (and stock (< n (cfg-idle-n cfg)))
      (push (format nil "N capped at ~D (of ~D): stock Hunchentoot spends a thread per ~
                         connection and by default has at most 100 (max-thread-count), ~
                         answering 503 beyond 120 (max-accept-count)"
                    n (cfg-idle-n cfg))
            notes))
    (progress-begin rep cfg (format nil "idle: ~D idle keep-alive conns + wrk -c100" n) name)
    (unwind-protect
         (progn
           (multiple-value-bind (new why) (start-ready cfg name 0)
             (setf server new)
             (unless server
               (fail-row base why)
               (fail-row row why)
               (return-from run-idle nil)))
           (warm-up cfg (list server))
           (measure cfg base server)
           (sleep (cfg-settle cfg))
           (multiple-value-bind (rss threads) (tree-status (srv-pid server))
             (setf (gethash "rss_before_kb" row) rss
                   (gethash "threads_before" row) threads))
           (let ((timeout (+ 30 (ceiling n 100))))
             (multiple-value-bind (program args)
                 (pin (cfg-client-cpus cfg) (lisp-sh)
                      (list "--load" "bench/idle.lisp" "--end-toplevel-options"
                            (princ-to-string (srv-port server)) (princ-to-string n)
                            (princ-to-string timeout) (princ-to-string *idle-batch*)))
               (setf helper (spawn program args :input :stream :output :stream
                                                :error (namestring (log-path cfg "idle" (srv-port server))))))
             (let* ((line (read-line-timeout (sb-ext:process-output helper) (+ timeout 30)))
                    (fields (and line (uiop:string-prefix-p "HELD " line) (parse-fields line))))
               (unless fields
                 (fail-row row (format nil "idle helper did not report (~A)" (or line "no output")))
                 (return-from run-idle nil))
               (setf (gethash "idle_held" row) (getf fields :held)
                     (gethash "idle_open_ms" row) (getf fields :ms))
               (when (plusp (getf fields :failed 0))
                 (push (format nil "~D of ~D idle connections failed to open (~A)"
                               (getf fields :failed) n (subseq line 5))
                       notes))
               (when (zerop (getf fields :held 0))
                 (fail-row row "no idle connection could be opened")
                 (return-from run-idle nil))))
           (sleep (cfg-settle cfg))
           (multiple-value-bind (rss threads) (tree-status (srv-pid server))
             (setf (gethash "rss_idle_kb" row) rss
                   (gethash "threads_idle" row) threads))
           (let ((stats (server-stats server)))
             (when (getf stats :open)
               (push (format nil "with idle connections: ~A" (fmt-stats stats)) notes)))
           (measure cfg row server)
           (when (send-line helper "check")
             (let ((line (read-line-timeout (sb-ext:process-output helper) 30)))
               (when (and line (uiop:string-prefix-p "ALIVE " line))
                 (setf (gethash "idle_alive" row)
                       (parse-integer line :start 6 :junk-allowed t)))))
           (let ((stats (server-stats server)))
             (when (getf stats :open)
               (push (format nil "after the load: ~A" (fmt-stats stats)) notes))))
      (setf (gethash "note" row) (format nil "~{~A~^; ~}" (reverse notes)))
      (when helper
        (send-line helper "quit")
        (ignore-errors (close (sb-ext:process-input helper)))
        (unless (wait-exit helper 10) (kill-process helper))
        (reap helper))
      (stop-server server)
      (record tsv base)
      (record tsv row)
      (progress-end (format nil "~A; with ~A idle held: ~A"
                            (row-summary base) (or (gethash "idle_held" row) 0) (row-summary row))))))

;;; Setup

(defun first-line-with (path prefix)
  (ignore-errors
   (with-open-file (in path)
     (loop for line = (read-line in nil)
           while line
           when (uiop:string-prefix-p prefix line)
             return line))))

(defun after-colon (line)
  (and line (string-trim " \"	" (subseq line (1+ (or (position #\: line) (position #\= line) -1))))))

(defun machine-meta ()
  (let ((mem-kb (parse-integer (or (after-colon (first-line-with "/proc/meminfo" "MemTotal")) "0")
                               :junk-allowed t)))
    (list (cons "cpu" (or (after-colon (first-line-with "/proc/cpuinfo" "model name")) "?"))
          (cons "cores" (cpu-count))
          (cons "memory" (format nil "~,1F GiB" (/ (or mem-kb 0) 1048576)))
          (cons "os" (or (after-colon (first-line-with "/etc/os-release" "PRETTY_NAME")) "?"))
          (cons "kernel" (string-trim '(#\Newline) (or (ignore-errors (uiop:read-file-string "/proc/sys/kernel/osrelease")) "?"))))))

(defun software-meta (cfg)
  (flet ((output-line (program &rest args)
           (let ((out (ignore-errors (run-capture program args))))
             (and out (string-trim '(#\Space #\Newline) (first (split out #\Newline)))))))
    (list (cons "sbcl" (lisp-implementation-version))
          (cons "hunchentoot"
                (or (ignore-errors
                     (handler-bind ((warning #'muffle-warning))
                       (asdf:component-version (asdf:find-system "hunchentoot"))))
                    "?"))
          (cons "nginx" (let ((line (and (member "nginx" (cfg-servers cfg) :test #'string=)
                                         (output-line (or (nginx-program) "nginx") "-v"))))
                          (if line
                              (string-trim " " (subseq line (1+ (or (position #\: line) -1))))
                              "n/a")))
          (cons "wrk" (let ((line (output-line "wrk" "-v")))
                        (if line
                            (string-trim " " (subseq line 0 (or (search "Copyright" line) (length line))))
                            "?")))
          (cons "gallop"
                (multiple-value-bind (commit code)
                    (ignore-errors (run-capture "git" '("rev-parse" "--short" "HEAD")))
                  (if (eql code 0)
                      (let ((dirty (run-capture "git" '("status" "--porcelain" "--" "src" "gallop.asd"))))
                        (format nil "commit ~A~:[~; with uncommitted changes in src/~]"
                                (string-trim '(#\Newline #\Space) commit)
                                (plusp (length (string-trim '(#\Newline #\Space) dirty)))))
                      "(not a git checkout)"))))))

(defun cpu-policy (cfg)
  "How CFG's current setup shares the machine's cores, for BENCHMARKS.md."
  (cond
    ((eq (cfg-setup cfg) :shared)
     (format nil "**Shared** (unpinned): nothing is pinned. The servers, wrk (`-t~D`, a thread per ~
core) and the harness share all ~D cores as a server shares a real machine with its load ~
balancer, database and clients; nginx runs `worker_processes ~A`~:[~*~; (~D workers)~]. The kernel ~
places every thread, so a number also depends on how much CPU wrk took from the server in that ~
run: CPU µs per request is the fair measure here, and req/s the server's ratio to nginx in the ~
same setup.~:[~*~; The CPU-hog scenarios add a busy loop (`~A`) for the whole wrk run: another ~
process taking one core.~]"
             (cfg-wrk-threads cfg) (cpu-count)
             (nginx-workers cfg) (equal (nginx-workers cfg) "auto") (cpu-count)
             (some (lambda (s) (getf s :hog)) (cfg-scenarios cfg))
             (multiple-value-call #'command-line (hog-command))))
    ((and (cfg-server-cpus cfg) (cfg-client-cpus cfg))
     (format nil "**Pinned**: the load generator and the server each get their own core: every ~
server process (all its threads; nginx's master and worker) runs under `taskset -c ~A`, and wrk, ~
the idle-connections helper, curl and the harness itself under `taskset -c ~A`. wrk runs ~D ~
thread~:P (`-t~:*~D`) because it owns ~D core~:P: more threads would only time-slice with each ~
other. nginx runs ~A worker process~:[es~;~] for the same reason. So the numbers are each ~
server's throughput and cost on ~A core~:P, with no competition from the load generator; a ~
handler's `sleep` still blocks only its thread, not the core. Whether wrk itself is the limit ~
shows in the nginx rows: a Lisp server far below nginx is not limited by wrk."
             (cfg-server-cpus cfg) (cfg-client-cpus cfg)
             (cfg-wrk-threads cfg) (count-cpus (cfg-client-cpus cfg))
             (nginx-workers cfg) (equal (nginx-workers cfg) "1")
             (count-cpus (cfg-server-cpus cfg))))
    (t
     (format nil "**Pinned** setup without pinning (~:[fewer than 2 cores~;BENCH_SERVER_CPUS or ~
BENCH_CLIENT_CPUS set to none~]): wrk (`-t~D`) and the servers share all ~D cores; nginx runs ~
`worker_processes ~A`."
             (>= (cpu-count) 2) (cfg-wrk-threads cfg) (cpu-count) (nginx-workers cfg)))))

(defun make-target (cfg)
  (ecase (cfg-mode cfg)
    (:full "make bench") (:quick "make bench-quick") (:smoke "make bench-smoke") (:tls "make bench-tls")
    (:processes "make bench-processes")))

(defun commands-meta (cfg)
  "The exact commands of CFG's current setup, for BENCHMARKS.md."
  (let ((env (loop for name in '("BENCH_REPS" "BENCH_DURATION" "BENCH_WARMUP" "BENCH_IDLE_N" "BENCH_IDLE_STOCK_MAX"
                                 "BENCH_SERVERS" "BENCH_PORT" "BENCH_SETUPS" "BENCH_SERVER_CPUS" "BENCH_CLIENT_CPUS"
                                 "BENCH_WRK_THREADS" "BENCH_MESSAGE_LOG" "BENCH_SCENARIOS")
                   when (env name) collect (format nil "~A=~A" name (shell-quote (env name))))))
    (with-output-to-string (out)
      (format out "# the whole run (installs wrk and nginx-light when missing):~%~{~A ~}~A~%"
              env (make-target cfg))
      (format out "#   = scripts/deps.sh wrk nginx-light && scripts/lisp.sh --load bench/run.lisp --eval '(gallop-bench:main ~(~S~))'~%"
              (cfg-mode cfg))
      (let* ((lisp (remove "nginx" (cfg-servers cfg) :test #'string=))
             (single (remove-if-not (lambda (n) (= (server-process-count n) 1)) lisp))
             (several (remove-if (lambda (n) (= (server-process-count n) 1)) lisp))
             (sleeps (remove-duplicates (mapcar (lambda (s) (getf s :sleep)) (cfg-scenarios cfg)))))
        (flet ((kinds-and-ports (names)
                 (list (remove-duplicates (mapcar (lambda (n) (string-downcase (server-kind n))) names)
                                          :test #'string= :from-end t)
                       (mapcar (lambda (n) (server-port cfg n)) names)
                       sleeps))
               (command (reuse-port)
                 (multiple-value-bind (program args)
                     (server-command cfg "KIND" "PORT" "SLEEP-MS" :reuse-port reuse-port)
                   (uiop:frob-substrings (command-line program args) (list (lisp-sh)) "scripts/lisp.sh"))))
          (when single
            (apply #'format out "# each Lisp server, KIND = ~{~A~^ | ~} on PORT = ~{~D~^ | ~}, SLEEP-MS = ~{~D~^ | ~}:~%~A~%"
                   (append (kinds-and-ports single) (list (command nil)))))
          (when several
            (apply #'format out "# ~R processes on one port, each bound with SO_REUSEPORT, KIND = ~{~A~^ | ~} on PORT = ~{~D~^ | ~}, SLEEP-MS = ~{~D~^ | ~}; each:~%~A~%"
                   (server-process-count (first several))
                   (append (kinds-and-ports several) (list (command t)))))))
      (when (member "nginx" (cfg-servers cfg) :test #'string=)
        (format out "# nginx on PORT ~D (nginx.conf below):~%" (server-port cfg "nginx"))
        (multiple-value-bind (program args) (nginx-command cfg "DIR/")
          (format out "~A~%" (command-line program args))))
      (format out "# each measurement: C = ~{~D~^ | ~}~:[~;, plus -H 'Connection: close' in the close scenarios~]:~%"
              (remove-duplicates (mapcar (lambda (s) (getf s :connections)) (cfg-scenarios cfg))
                                 :from-end t)
              (some (lambda (s) (getf s :close)) (cfg-scenarios cfg)))
      (multiple-value-bind (program args)
          (pin (cfg-client-cpus cfg) "wrk" (wrk-args cfg "PORT" 100 nil (cfg-duration cfg)))
        (format out "~A~%" (uiop:frob-substrings (command-line program args) '("-c100") "-cC")))
      (when (and (eq (cfg-setup cfg) :shared) (some (lambda (s) (getf s :hog)) (cfg-scenarios cfg)))
        (format out "# CPU-hog scenarios (~{~A~^, ~}): for the whole wrk run, beside it:~%~A~%"
                (mapcar #'scenario-key (remove-if-not (lambda (s) (getf s :hog)) (cfg-scenarios cfg)))
                (multiple-value-call #'command-line (hog-command))))
      (when (plusp (cfg-warmup cfg))
        (format out "# warm-up after each server start (not recorded):~%")
        (multiple-value-bind (program args)
            (pin (cfg-client-cpus cfg) "wrk" (wrk-args cfg "PORT" 10 nil (cfg-warmup cfg)))
          (format out "~A~%" (command-line program args))))
      (when (and (eq (cfg-setup cfg) (first (cfg-setups cfg))) (plusp (cfg-idle-n cfg)))
        (format out "# idle connections: N = ~D (~D for stock Hunchentoot), held open during the -c100 keep-alive run:~%"
                (cfg-idle-n cfg) (min (cfg-idle-n cfg) (cfg-idle-stock-max cfg)))
        (multiple-value-bind (program args)
            (pin (cfg-client-cpus cfg) "scripts/lisp.sh"
                 (list "--load" "bench/idle.lisp" "--end-toplevel-options" "PORT" "N" "TIMEOUT-S"
                       (princ-to-string *idle-batch*)))
          (format out "~A" (command-line program args)))))))

(defun pin-self (cfg)
  "Move this harness (every thread) to the client CPUs, or let it run on
every CPU when there are none."
  (when (find-program "taskset")
    (run-capture "taskset" (list "-a" "-p" "-c" (or (cfg-client-cpus cfg)
                                                    (format nil "0-~D" (1- (cpu-count))))
                                 (princ-to-string (sb-unix:unix-getpid))))))

(defun check-tools (cfg)
  (let ((missing (append (unless (find-program "wrk") '("wrk"))
                         (unless (find-program "curl") '("curl"))
                         (unless (find-program "taskset")
                           '("taskset (util-linux)"))
                         (unless (or (not (member "nginx" (cfg-servers cfg) :test #'string=))
                                     (nginx-program))
                           '("nginx")))))
    (when missing
      (error "Missing: ~{~A~^, ~}. Install with: scripts/deps.sh wrk nginx-light" missing))))

(defun precompile (cfg)
  "Compile Gallop and Hunchentoot once, before servers start in parallel."
  (format t "~&Compiling gallop (fasls are cached)...~%")
  (finish-output)
  (multiple-value-bind (out code)
      (run-capture (lisp-sh) (list "--eval" "(asdf:load-system \"gallop\")"))
    (let ((log (log-path cfg "compile" 0)))
      (write-string-to-file out (ensure-directories-exist log))
      (unless (eql code 0)
        (error "Loading gallop failed (exit ~A); see ~A" code (namestring log))))))

(defun check-ports (cfg)
  (dolist (name (cfg-servers cfg))
    (let ((port (server-port cfg name)))
      (unless (port-free-p port)
        (error "Port ~D on 127.0.0.1 is in use (another benchmark running?); ~
                set BENCH_PORT to another base port." port)))))

(defun setups-meta-lines (cfg)
  "The TSV's meta lines for each setup: its CPUs, wrk threads, CPU policy,
commands and nginx.conf, under keys suffixed _pinned or _shared."
  (loop for setup in (cfg-setups cfg)
        append (progn
                 (apply-setup cfg setup)
                 (mapcar (lambda (entry)
                           (cons (format nil "~A_~(~A~)" (car entry) setup) (cdr entry)))
                         (list (cons "server_cpus" (or (cfg-server-cpus cfg) "any"))
                               (cons "client_cpus" (or (cfg-client-cpus cfg) "any"))
                               (cons "wrk_threads" (cfg-wrk-threads cfg))
                               (cons "nginx_workers" (nginx-workers cfg))
                               (cons "cpu_policy" (cpu-policy cfg))
                               (cons "commands" (commands-meta cfg))
                               (cons "nginx_conf" (nginx-conf cfg "DIR/" "PORT")))))))

(defun run-all (cfg)
  (let* ((nservers (length (cfg-servers cfg)))
         (per-rep (loop for setup in (cfg-setups cfg)
                        sum (* nservers
                               (+ (length (setup-scenarios (apply-setup cfg setup)))
                                  (if (and (eq setup (first (cfg-setups cfg)))
                                           (plusp (cfg-idle-n cfg)))
                                      1 0))))))
    (setf *steps-total* (* (cfg-reps cfg) per-rep)
          *steps-done* 0
          *failures* 0)
    (with-open-file (tsv (ensure-directories-exist (cfg-tsv cfg))
                         :direction :output :if-exists :supersede :external-format :utf-8)
      (write-tsv-meta tsv (append (list (cons "run_id" (cfg-run-id cfg))
                                        (cons "mode" (string-downcase (cfg-mode cfg)))
                                        (cons "started" (timestamp (get-universal-time) :human))
                                        (cons "reps" (cfg-reps cfg))
                                        (cons "duration_s" (cfg-duration cfg))
                                        (cons "warmup_s" (cfg-warmup cfg))
                                        (cons "idle_n" (cfg-idle-n cfg))
                                        (cons "idle_batch" *idle-batch*)
                                        (cons "setups" (format nil "~(~{~A~^,~}~)" (cfg-setups cfg))))
                                  (machine-meta)
                                  (software-meta cfg)
                                  (setups-meta-lines cfg)))
      (write-tsv-header tsv)
      (finish-output tsv)
      ;; Each repetition runs every setup, so that slow drifts of the machine
      ;; spread over both; the idle-connections scenario runs in the first.
      (loop for rep from 1 to (cfg-reps cfg)
            do (dolist (setup (cfg-setups cfg))
                 (apply-setup cfg setup)
                 (pin-self cfg)
                 (let ((scenarios (setup-scenarios cfg)))
                   (dolist (sleep-ms (remove-duplicates (mapcar (lambda (s) (getf s :sleep)) scenarios)
                                                        :from-end t))
                     (run-matrix-group cfg tsv rep sleep-ms
                                       (remove-if-not (lambda (s) (eql (getf s :sleep) sleep-ms))
                                                      scenarios))))
                 (when (and (eq setup (first (cfg-setups cfg))) (plusp (cfg-idle-n cfg)))
                   (dolist (name (rotate (cfg-servers cfg) rep))
                     (run-idle cfg tsv rep name)))))
      (write-tsv-meta tsv (list (cons "elapsed" (clock (elapsed))))))))

(defun main (&optional (mode :full))
  "Run the benchmark in MODE (:full, :quick, :smoke, :tls or :processes),
write the report and exit: 0 when everything ran, 1 when anything failed."
  (let ((cfg (make-cfg mode))
        (code 1))
    (setf *start-time* (get-internal-real-time))
    (unwind-protect
         (handler-case
             (progn
               (setf *tls* (and (eq mode :tls)
                                (make-tls-certificate (merge-pathnames "tls/" (cfg-tmp-dir cfg)))))
               (apply-setup cfg (first (cfg-setups cfg)))
               (check-tools cfg)
               (check-ports cfg)
               (precompile cfg)
               (format t "~&~A: ~D repetition~:P x ~D scenarios x ~D servers x setups ~(~{~A~^, ~}~)~:[~*~; + idle connections (N=~D)~], ~D s per run~%"
                       (make-target cfg) (cfg-reps cfg) (length (cfg-scenarios cfg))
                       (length (cfg-servers cfg)) (cfg-setups cfg)
                       (plusp (cfg-idle-n cfg)) (cfg-idle-n cfg) (cfg-duration cfg))
               (format t "Pinned: servers on CPU ~A, wrk -t~D on CPU ~A; shared: nothing pinned, wrk -t~D; results: ~A~%"
                       (or (cfg-pinned-server-cpus cfg) "any") (cfg-pinned-wrk-threads cfg)
                       (or (cfg-pinned-client-cpus cfg) "any") (cpu-count)
                       (enough-namestring (cfg-tsv cfg) *repo*))
               (finish-output)
               (run-all cfg)
               (format t "~&~%")
               (report (cfg-tsv cfg) :md (cfg-md cfg) :svg (cfg-svg cfg) :summary (cfg-summary cfg))
               (unless (and (probe-file (cfg-md cfg))
                            (or (null (cfg-svg cfg)) (probe-file (cfg-svg cfg)))
                            (or (null (cfg-summary cfg)) (probe-file (cfg-summary cfg))))
                 (error "The report was not written"))
               (format t "~&Done in ~A. Raw results: ~A~%Report: ~A~%~@[Summary: ~A~%~]~@[Chart: ~A~%~]"
                       (clock (elapsed))
                       (enough-namestring (cfg-tsv cfg) *repo*)
                       (enough-namestring (cfg-md cfg) *repo*)
                       (and (cfg-summary cfg) (enough-namestring (cfg-summary cfg) *repo*))
                       (and (cfg-svg cfg) (enough-namestring (cfg-svg cfg) *repo*)))
               (if (zerop *failures*)
                   (setf code 0)
                   (format t "~&~D run~:P FAILED (see \"Failed runs\" in the report).~%" *failures*)))
           (sb-sys:interactive-interrupt ()
             (format t "~&Interrupted.~%")
             (setf code 130))
           (error (e)
             (format t "~&Benchmark harness error: ~A~%" e)
             (setf code 2)))
      (kill-all-live))
    (finish-output)
    (uiop:quit code)))
