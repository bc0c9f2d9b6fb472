;;;; report.lisp -- from a results TSV (bench/results/*.tsv) to the run's
;;;; report (RUN.md beside the TSV: every table), the summary spliced into
;;;; BENCHMARKS.md (a table per setup, a line per scenario) and the SVG chart.
;;;;
;;;; The TSV is the whole record of a run: "# key<TAB>value" lines first (the
;;;; machine, versions, settings, exact commands), then a header line and one
;;;; line per wrk run.  The report is a pure function of it, so it can be
;;;; redrawn without running anything:
;;;;
;;;;   scripts/lisp.sh --load bench/run.lisp \
;;;;     --eval '(gallop-bench:report "bench/results/RUN.tsv" :md "bench/results/RUN.md"
;;;;               :svg "BENCHMARKS.svg" :summary "BENCHMARKS.md")'
;;;;
;;;; (:md "/tmp/x.md" :svg "/tmp/x.svg" alone redraws a run's report and
;;;; chart without touching BENCHMARKS.md.)

(in-package #:gallop-bench)

;;; Servers

(defparameter *servers*
  '(("stock" :stock "Hunchentoot (stock)" "stock")
    ("gallop" :gallop "gallop:easy-acceptor" "easy-acceptor")
    ("gallop-tm" :gallop-tm "gallop:taskmaster" "taskmaster")
    ("native" :native "gallop:start (native)" "start")
    ("nginx" :nginx "nginx (reference)" "nginx")
    ;; The many-processes row (make bench-processes): two processes of a
    ;; kind on one port, bound with :REUSE-PORT.  Last, so that the
    ;; others keep their ports (SERVER-PORT).
    ("native-2p" :native "gallop:start (native), 2 processes" "start ×2" 2)
    ("gallop-2p" :gallop "gallop:easy-acceptor, 2 processes" "easy-acceptor ×2" 2))
  "Each server: its name in the TSV, its kind, its label in tables and charts,
its short label in the summary tables' column heads, and how many processes
serve its port (1 when not given).")

(defun server-kind (name) (second (assoc name *servers* :test #'string=)))
(defun server-label (name) (or (third (assoc name *servers* :test #'string=)) name))
(defun server-short-label (name) (or (fourth (assoc name *servers* :test #'string=)) name))
(defun server-name (kind) (first (find kind *servers* :key #'second)))
(defun server-process-count (name)
  "How many processes serve server NAME's port: 1, or 2 for the
many-processes row's servers."
  (or (fifth (assoc name *servers* :test #'string=)) 1))

(defparameter *server-descriptions*
  '(("stock" . "`(make-instance 'hunchentoot:easy-acceptor :address \"127.0.0.1\" :port P :access-log-destination nil :message-log-destination nil)`: the default one-thread-per-connection taskmaster (max-thread-count 100, max-accept-count 120, listen backlog 50). Its process loads Hunchentoot only.")
    ("gallop" . "`(make-instance 'gallop:easy-acceptor ...same initargs...)`: the drop-in acceptor (Gallop's defaults: pool of 4 to 100 workers, listen backlog 1024).")
    ("gallop-tm" . "`(make-instance 'hunchentoot:easy-acceptor ...same initargs... :taskmaster (make-instance 'gallop:taskmaster))`: Gallop's taskmaster on a stock acceptor (Hunchentoot's listener thread accepts, listen backlog 50).")
    ("native" . "`(gallop:start app :address \"127.0.0.1\" :port P)`: Gallop's native app API, with a Clack-style app doing what /yo does (own HTTP/1.1 parsing and writing, no Hunchentoot). Its process does not load Gallop's Hunchentoot layer.")
    ("nginx" . "Debian's nginx, `return 200 \"Hey!\"` for `/yo`, access log off, its worker processes as \"Sharing two cores\" below says: the reference for what this machine can do. It never sleeps, so in the sleep 1 ms scenarios it is the machine's ceiling, not a peer.")
    ("native-2p" . "two `gallop:start` processes as above, each `(gallop:start app :address \"127.0.0.1\" :port P :reuse-port t)` (`BENCH_REUSE_PORT=1`): each binds its own listening socket with `SO_REUSEPORT`, and the kernel spreads new connections over the two by a hash of their addresses. Each has its own heap, GC and pool.")
    ("gallop-2p" . "two `gallop:easy-acceptor` processes as above, each with `:reuse-port t` (`BENCH_REUSE_PORT=1`).")))

;;; TSV

(defparameter *columns*
  '("run_id" "mode" "setup" "rep" "scenario" "sleep_ms" "connection" "connections" "server"
    "duration_s" "requests" "rps" "ok_rps" "p50_ms" "p90_ms" "p99_ms"
    "err_connect" "err_read" "err_write" "err_timeout" "non2xx" "cpu_s" "cpu_us_per_req" "status"
    "idle_n" "idle_held" "idle_alive" "idle_open_ms" "rss_before_kb" "rss_idle_kb"
    "threads_before" "threads_idle" "threads_max" "note" "command")
  "The columns of a results TSV, in order.  READ-TSV goes by the header line,
so a TSV written before a column existed (cpu_s and cpu_us_per_req are
younger than the first runs, setup and threads_max younger still) still
reads: its missing cells are unknown, shown as \"–\", and a row without a
setup was pinned.")

(defun tsv-clean (value)
  "VALUE as one TSV field: no tabs or newlines."
  (substitute-if #\Space (lambda (c) (member c '(#\Tab #\Newline #\Return)))
                 (cond ((null value) "")
                       ((integerp value) (format nil "~D" value))
                       ((realp value) (format nil "~,3F" value))
                       (t (princ-to-string value)))))

(defun escape-meta (string)
  (with-output-to-string (out)
    (loop for c across string
          do (case c
               (#\\ (write-string "\\\\" out))
               (#\Newline (write-string "\\n" out))
               (#\Tab (write-string "\\t" out))
               (t (write-char c out))))))

(defun unescape-meta (string)
  (with-output-to-string (out)
    (loop with i = 0
          while (< i (length string))
          do (let ((c (char string i)))
               (if (and (char= c #\\) (< (1+ i) (length string)))
                   (progn (write-char (case (char string (1+ i))
                                        (#\n #\Newline) (#\t #\Tab) (t (char string (1+ i))))
                                      out)
                          (incf i 2))
                   (progn (write-char c out) (incf i)))))))

(defun write-tsv-meta (stream meta)
  (loop for (key . value) in meta
        do (format stream "# ~A~C~A~%" key #\Tab (escape-meta (princ-to-string value)))))

(defun write-tsv-header (stream)
  (format stream "~{~A~^	~}~%" *columns*))

(defun write-tsv-row (stream row)
  "ROW: a hash table from column name to value."
  (format stream "~{~A~^	~}~%" (mapcar (lambda (c) (tsv-clean (gethash c row))) *columns*))
  (finish-output stream))

(defun split (string char)
  (loop with start = 0
        for pos = (position char string :start start)
        collect (subseq string start pos)
        while pos
        do (setf start (1+ pos))))

(defun read-tsv (path)
  "The metadata (an alist) and the rows (hash tables of strings) of PATH."
  (with-open-file (in path :external-format :utf-8)
    (let ((meta '()) (header nil) (rows '()))
      (loop for line = (read-line in nil)
            while line
            do (cond ((zerop (length line)))
                     ((char= (char line 0) #\#)
                      (let* ((body (string-left-trim "# " line))
                             (tab (position #\Tab body)))
                        (when tab
                          (push (cons (subseq body 0 tab) (unescape-meta (subseq body (1+ tab))))
                                meta))))
                     ((null header) (setf header (split line #\Tab)))
                     (t (let ((row (make-hash-table :test #'equal)))
                          (loop for column in header
                                for value in (split line #\Tab)
                                do (setf (gethash column row) value))
                          (push row rows)))))
      (values (nreverse meta) (nreverse rows)))))

(defun meta (meta key &optional default)
  (or (cdr (assoc key meta :test #'string=)) default))

(defun setup-meta (meta key setup &optional default)
  "KEY's value for SETUP (\"pinned\" or \"shared\"): KEY_SETUP, or KEY in
runs recorded before there were setups."
  (or (meta meta (format nil "~A_~A" key setup)) (meta meta key default)))

;;; Numbers

(defun cell (row column)
  "ROW's COLUMN as a number (rows read back hold strings, live rows numbers)."
  (let ((value (gethash column row)))
    (if (realp value) value (parse-decimal value))))

(defun median (numbers)
  (let* ((sorted (sort (copy-list (remove nil numbers)) #'<))
         (n (length sorted)))
    (cond ((zerop n) nil)
          ((oddp n) (nth (floor n 2) sorted))
          (t (/ (+ (nth (1- (floor n 2)) sorted) (nth (floor n 2) sorted)) 2)))))

(defun fmt-int (x)
  (if x (format nil "~:D" (round x)) "–"))

(defun fmt-ms (ms)
  (cond ((null ms) "–")
        ((< ms 1) (format nil "~,2F ms" ms))
        ((< ms 10) (format nil "~,2F ms" ms))
        ((< ms 100) (format nil "~,1F ms" ms))
        ((< ms 1000) (format nil "~D ms" (round ms)))
        (t (format nil "~,2F s" (/ ms 1000)))))

(defun fmt-us (us)
  "Microseconds of server CPU per request, to a tenth below 100 µs: a 1 s
run of 10,000 requests or more resolves 1 µs (one clock tick, 10 ms, in 10,000)."
  (cond ((null us) "–")
        ((< us 100) (format nil "~,1F" us))
        (t (fmt-int us))))

(defun fmt-ratio (x)
  (cond ((null x) "–")
        ((>= x 10) (format nil "~,1F×" x))
        (t (format nil "~,2F×" x))))

;;; Grouping

(defun row-ok-p (row)
  (string= (gethash "status" row "") "ok"))

(defun row-setup (row)
  "\"pinned\" or \"shared\" (rows recorded before there were setups were pinned)."
  (let ((setup (gethash "setup" row)))
    (if (and setup (plusp (length setup))) setup "pinned")))

(defun rows-in-setup (rows setup)
  (remove-if-not (lambda (r) (string= (row-setup r) setup)) rows))

(defun setups-present (rows)
  (remove-if-not (lambda (setup) (find setup rows :key #'row-setup :test #'string=))
                 '("pinned" "shared")))

(defun setup-title (setup)
  (if (string= setup "shared")
      "Shared: server unpinned, beside wrk on every core"
      "Pinned: server on one core, wrk on the other"))

(defun hog-scenario-p (scenario)
  (uiop:string-suffix-p scenario "-hog"))

(defun scenario-sort-key (row)
  (list (or (cell row "sleep_ms") 0)
        (if (string= (gethash "connection" row "") "close") 1 0)
        (or (cell row "connections") 0)))

(defun key< (a b)
  (loop for x in a for y in b
        do (cond ((< x y) (return t))
                 ((> x y) (return nil)))))

(defun matrix-scenarios (rows)
  "The matrix scenarios present, in report order: sleep, then keep-alive before
close, then connections."
  (let ((seen '()))
    (dolist (row rows)
      (let ((s (gethash "scenario" row)))
        (unless (or (member s '("idle" "idle-base") :test #'string=)
                    (assoc s seen :test #'string=))
          (push (cons s row) seen))))
    (mapcar #'car (sort seen #'key< :key (lambda (e) (scenario-sort-key (cdr e)))))))

(defun servers-present (rows)
  (loop for (name) in *servers*
        when (find name rows :key (lambda (r) (gethash "server" r)) :test #'string=)
          collect name))

(defun rows-of (rows scenario server)
  (remove-if-not (lambda (r) (and (string= (gethash "scenario" r) scenario)
                                  (string= (gethash "server" r) server)))
                 rows))

(defun scenario-title (row)
  (format nil "sleep ~D ms, ~A, ~D connections~:[~;, CPU hog on one core~]"
          (round (or (cell row "sleep_ms") 0))
          (if (string= (gethash "connection" row) "close") "Connection: close" "keep-alive")
          (round (or (cell row "connections") 0))
          (hog-scenario-p (gethash "scenario" row))))

(defun summarize (runs)
  "Medians over the successful RUNS of one scenario and server, as a plist."
  (let ((ok (remove-if-not #'row-ok-p runs)))
    (flet ((med (column) (median (mapcar (lambda (r) (cell r column)) ok))))
      (let ((ok-rps (mapcar (lambda (r) (cell r "ok_rps")) ok)))
        (list :runs (length runs) :ok (length ok)
              :rps (med "rps") :ok-rps (med "ok_rps")
              :spread (let ((m (median ok-rps)))
                        (when (and m (plusp m) (> (length ok) 1))
                          (/ (- (reduce #'max ok-rps) (reduce #'min ok-rps)) 2 m)))
              :p50 (med "p50_ms") :p99 (med "p99_ms")
              :cpu-us (med "cpu_us_per_req")
              :threads (med "threads_max")
              :connect (med "err_connect") :read (med "err_read")
              :write (med "err_write") :timeout (med "err_timeout")
              :non2xx (med "non2xx"))))))

(defun fmt-errors (s)
  (let ((errors (list (getf s :connect) (getf s :read) (getf s :write) (getf s :timeout))))
    (cond ((some #'null errors) "–")
          ((every #'zerop errors) "0")
          (t (format nil "~{~D~^/~}" (mapcar #'round errors))))))

;;; Markdown

(defun write-scenario-table (out rows scenario servers)
  (let* ((stock (summarize (rows-of rows scenario "stock")))
         (stock-ok (getf stock :ok-rps)))
    (format out "| server | req/s | CPU µs/req | 2xx req/s | vs stock | p50 | p99 | socket errors c/r/w/t | non-2xx | threads | runs ok |~%")
    (format out "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|~%")
    (dolist (server servers)
      (let ((s (summarize (rows-of rows scenario server))))
        (if (zerop (getf s :ok))
            (format out "| ~A | failed | | | | | | | | | 0/~D |~%" (server-label server) (getf s :runs))
            (format out "| ~A | ~A | ~A | ~A~@[ ±~D%~] | ~A | ~A | ~A | ~A | ~A | ~A | ~D/~D |~%"
                    (server-label server) (fmt-int (getf s :rps)) (fmt-us (getf s :cpu-us))
                    (fmt-int (getf s :ok-rps))
                    (and (getf s :spread) (round (* 100 (getf s :spread))))
                    (cond ((string= server "stock") "1.00×")
                          ((and stock-ok (plusp stock-ok) (getf s :ok-rps))
                           (fmt-ratio (/ (getf s :ok-rps) stock-ok)))
                          (t "–"))
                    (fmt-ms (getf s :p50)) (fmt-ms (getf s :p99)) (fmt-errors s)
                    (fmt-int (getf s :non2xx)) (fmt-int (getf s :threads))
                    (getf s :ok) (getf s :runs)))))
    (terpri out)))

(defun write-setup-comparison (out rows servers)
  "Each scenario run in both setups, each server: its cost per request
pinned and shared, and its throughput shared against nginx's."
  (let ((pinned (rows-in-setup rows "pinned"))
        (shared (rows-in-setup rows "shared")))
    (format out "| scenario | server | pinned req/s | pinned CPU µs/req | shared req/s | shared CPU µs/req | shared ÷ pinned CPU | shared vs nginx | shared threads |~%")
    (format out "|---|---|--:|--:|--:|--:|--:|--:|--:|~%")
    (dolist (scenario (matrix-scenarios shared))
      (unless (hog-scenario-p scenario)
        (let* ((row (find scenario shared :key (lambda (r) (gethash "scenario" r)) :test #'string=))
               (nginx (summarize (rows-of shared scenario "nginx"))))
          (dolist (server servers)
            (let ((p (summarize (rows-of pinned scenario server)))
                  (s (summarize (rows-of shared scenario server))))
              (when (plusp (getf s :runs))
                (format out "| ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A |~%"
                        (scenario-title row) (server-label server)
                        (fmt-int (getf p :ok-rps)) (fmt-us (getf p :cpu-us))
                        (fmt-int (getf s :ok-rps)) (fmt-us (getf s :cpu-us))
                        (if (and (getf p :cpu-us) (getf s :cpu-us) (plusp (getf p :cpu-us)))
                            (fmt-ratio (/ (getf s :cpu-us) (getf p :cpu-us)))
                            "–")
                        (if (and (getf nginx :ok-rps) (plusp (getf nginx :ok-rps)) (getf s :ok-rps))
                            (fmt-ratio (/ (getf s :ok-rps) (getf nginx :ok-rps)))
                            "–")
                        (fmt-int (getf s :threads)))))))))
    (terpri out)))

(defun write-hog-comparison (out rows servers)
  "Each CPU-hog scenario beside the same scenario without the hog (shared)."
  (let ((shared (rows-in-setup rows "shared")))
    (format out "| scenario | server | req/s without hog | with hog | CPU µs/req without | with | threads without | with | pool after the run with hog |~%")
    (format out "|---|---|--:|--:|--:|--:|--:|--:|---|~%")
    (dolist (scenario (matrix-scenarios shared))
      (when (hog-scenario-p scenario)
        (let ((row (find scenario shared :key (lambda (r) (gethash "scenario" r)) :test #'string=))
              (base (subseq scenario 0 (- (length scenario) (length "-hog")))))
          (dolist (server servers)
            (let ((w (summarize (rows-of shared scenario server)))
                  (wo (summarize (rows-of shared base server)))
                  (note (let ((r (find-if #'row-ok-p (rows-of shared scenario server))))
                          (and r (gethash "note" r)))))
              (when (plusp (getf w :runs))
                (format out "| ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A |~%"
                        (scenario-title row) (server-label server)
                        (fmt-int (getf wo :ok-rps)) (fmt-int (getf w :ok-rps))
                        (fmt-us (getf wo :cpu-us)) (fmt-us (getf w :cpu-us))
                        (fmt-int (getf wo :threads)) (fmt-int (getf w :threads))
                        ;; Gallop's pool (GALLOP:STATS); the others have none.
                        (if (and note (search "run-permits" note)) note "–"))))))))
    (terpri out)))

(defun rep-values (rows scenario server column)
  "COLUMN of SERVER's successful run in SCENARIO, by repetition: an alist
\(REP . VALUE)."
  (loop for r in (rows-of rows scenario server)
        when (and (row-ok-p r) (cell r column))
          collect (cons (cell r "rep") (cell r column))))

(defun rep-ratios (a b)
  "The ratio A ÷ B for each repetition both alists (REP . VALUE) have, in
order of repetition."
  (loop for (rep . x) in (sort (copy-list a) #'< :key #'car)
        for y = (cdr (assoc rep b))
        when (and y (plusp y))
          collect (/ x y)))

(defun pool-threads-in-note (note)
  "The pool's thread count in a GALLOP:STATS note (\"... threads=4 ...\"), or NIL."
  (let ((at (and note (search "threads=" note))))
    (and at (parse-integer note :start (+ at (length "threads=")) :junk-allowed t))))

;;; A goal of the every-core issue, as measured in one run: TEXT says what
;;; it is, VALUES are its ratio (or, when COUNT, its count) in each
;;; repetition, TEST is true of a median that meets it (NIL: a reference
;;; line, not a goal).
(defstruct goal text values test count)

(defun goals (rows meta)
  "The goals of the every-core issue that this run measured (GOAL records, in
the order of the report), each with its value in every repetition; NIL when
the run measured none of them."
  (let ((pinned (rows-in-setup rows "pinned"))
        (shared (rows-in-setup rows "shared"))
        (cores (parse-integer (princ-to-string (meta meta "cores" "0")) :junk-allowed t))
        (goals '()))
    (labels ((goal (text values test &optional count)
               (when values
                 (push (make-goal :text text :values values :test test :count count) goals)))
             (scenario (sleep conns &optional hog)
               (format nil "s~D-ka-c~D~:[~;-hog~]" sleep conns hog))
             (cpu-ratios (server conns)
               ;; SERVER's shared ÷ pinned CPU µs/req at 0 ms keep-alive.
               (rep-ratios (rep-values shared (scenario 0 conns) server "cpu_us_per_req")
                           (rep-values pinned (scenario 0 conns) server "cpu_us_per_req"))))
      (dolist (conns '(10 100 400))
        (goal (format nil "`gallop:start` shared vs nginx, 0 ms keep-alive, ~D connections (≥ 0.95×)" conns)
              (rep-ratios (rep-values shared (scenario 0 conns) "native" "ok_rps")
                          (rep-values shared (scenario 0 conns) "nginx" "ok_rps"))
              (lambda (m) (>= m 0.95))))
      (dolist (server '("native" "gallop"))
        (dolist (conns '(10 100 400))
          (goal (format nil "`~A` shared ÷ pinned CPU µs/req, 0 ms keep-alive, ~D connections (≤ 1.15×)"
                        (if (string= server "native") "gallop:start" "gallop:easy-acceptor") conns)
                (cpu-ratios server conns)
                (lambda (m) (<= m 1.15)))))
      ;; The same ratio for nginx, which has no pool to misjudge: how far
      ;; this run's host moved the ratio by itself.
      (dolist (conns '(10 100 400))
        (goal (format nil "reference, not a goal: nginx shared ÷ pinned CPU µs/req, 0 ms keep-alive, ~D connections" conns)
              (cpu-ratios "nginx" conns)
              nil))
      (dolist (server '("native" "gallop" "gallop-tm"))
        (goal (format nil "~A shared, 1 ms keep-alive, 400 ÷ 100 connections (≥ 0.9×)" (server-label server))
              (rep-ratios (rep-values shared (scenario 1 400) server "ok_rps")
                          (rep-values shared (scenario 1 100) server "ok_rps"))
              (lambda (m) (>= m 0.9))))
      ;; nginx never sleeps, so its 1 ms rows answer at once: their c400 ÷
      ;; c100 is what 400 connections cost this host against 100 for a
      ;; server that is CPU-bound at both, as the Lisp servers' 1 ms rows
      ;; are here.
      (goal "reference, not a goal: nginx shared, \"1 ms\" keep-alive (it does not sleep), 400 ÷ 100 connections"
            (rep-ratios (rep-values shared (scenario 1 400) "nginx" "ok_rps")
                        (rep-values shared (scenario 1 100) "nginx" "ok_rps"))
            nil)
      ;; The pool after the 0 ms run beside the CPU hog: no more than the CPUs
      ;; plus 2 workers.  A count, not a ratio.
      (when (and cores (plusp cores))
        (dolist (server '("native" "gallop" "gallop-tm"))
          (goal (format nil "~A's pool after 0 ms beside a CPU hog, threads (≤ ~D CPUs + 2)"
                        (server-label server) cores)
                (loop for r in (rows-of shared (scenario 0 100 t) server)
                      for n = (and (row-ok-p r) (pool-threads-in-note (gethash "note" r)))
                      when n collect n)
                (let ((most (+ cores 2))) (lambda (m) (<= m most)))
                t))))
    (nreverse goals)))

(defun fmt-goal-value (goal x)
  "One of GOAL's values: a count as it is, a ratio with two decimals."
  (if (goal-count goal) (format nil "~D" x) (format nil "~,2F" x)))

(defun fmt-goal-median (goal x)
  "GOAL's median X: a count as a number (the median of an even number of
counts may be half-way), a ratio with three decimals (a median shown as
1.15 may be over 1.15)."
  (cond ((not (goal-count goal)) (format nil "~,3F×" x))
        ((integerp x) (format nil "~D" x))
        (t (format nil "~,1F" x))))

(defun held-cell (goal median)
  (cond ((null (goal-test goal)) "–")
        ((funcall (goal-test goal) median) "yes")
        (t "**no**")))

(defun goal-lines (rows meta)
  "The goals of the every-core issue that this run measured, as markdown
table lines: each goal's median, its value in each repetition (the machine
is shared and noisy: a goal that holds only in the median shows it), and
whether the median holds.  NIL when the run measured none of them."
  (loop for goal in (goals rows meta)
        for m = (median (goal-values goal))
        collect (format nil "| ~A | ~A | ~{~A~^, ~} | ~A |"
                        (goal-text goal) (fmt-goal-median goal m)
                        (mapcar (lambda (x) (fmt-goal-value goal x)) (goal-values goal))
                        (held-cell goal m))))

(defun goals-across (tsv-paths &key (stream *standard-output*))
  "Write to STREAM a markdown table of the every-core goals over several runs
\(TSV-PATHS, in the order given): each run's median, in how many runs the
median held, and the median of every repetition of all the runs pooled.  On
a host whose speed moves from minute to minute, one run's median can miss
by the noise alone; a line that misses in most runs, or pooled, does not."
  (let* ((runs (mapcar (lambda (path)
                         (multiple-value-bind (meta rows) (read-tsv path)
                           (cons (pathname-name path) (goals rows meta))))
                       tsv-paths))
         (texts (remove-duplicates (loop for (nil . goals) in runs
                                         append (mapcar #'goal-text goals))
                                   :test #'string= :from-end t)))
    (format stream "| goal |~{ `~A` |~} held in | all repetitions pooled (n) | held |~%"
            (mapcar #'car runs))
    (format stream "|---|~{~A~}--:|--:|---|~%" (make-list (length runs) :initial-element "--:|"))
    (dolist (text texts)
      (let* ((found (loop for (nil . goals) in runs
                          collect (find text goals :key #'goal-text :test #'string=)))
             (some-goal (find-if #'identity found))
             (medians (mapcar (lambda (g) (and g (median (goal-values g)))) found))
             (pooled (loop for g in found when g append (goal-values g)))
             (pooled-median (median pooled)))
        (format stream "| ~A |~{ ~A |~} ~A | ~A (~D) | ~A |~%"
                text
                (mapcar (lambda (m) (if m (fmt-goal-median some-goal m) "–")) medians)
                (if (goal-test some-goal)
                    (format nil "~D of ~D" (count-if (lambda (m) (and m (funcall (goal-test some-goal) m)))
                                                     medians)
                            (count-if #'identity medians))
                    "–")
                (fmt-goal-median some-goal pooled-median) (length pooled)
                (held-cell some-goal pooled-median))))))

(defun idle-summary (rows server)
  "Medians of the idle-connections scenario for SERVER, pairing each
repetition's run with idle connections with its run without."
  (let* ((with (remove-if-not #'row-ok-p (rows-of rows "idle" server)))
         (base (remove-if-not #'row-ok-p (rows-of rows "idle-base" server)))
         (all-with (rows-of rows "idle" server)))
    (flet ((med (list column) (median (mapcar (lambda (r) (cell r column)) list)))
           (base-of (r) (find (gethash "rep" r) base :key (lambda (b) (gethash "rep" b))
                                                     :test #'string=)))
      (list :runs (length all-with) :ok (length with)
            :n (med all-with "idle_n") :held (med with "idle_held") :alive (med with "idle_alive")
            :open-ms (med with "idle_open_ms")
            :base-rps (med base "ok_rps") :with-rps (med with "ok_rps")
            :base-cpu-us (med base "cpu_us_per_req") :with-cpu-us (med with "cpu_us_per_req")
            :ratio (median (loop for r in with
                                 for b = (base-of r)
                                 for x = (cell r "ok_rps")
                                 for y = (and b (cell b "ok_rps"))
                                 when (and x y (plusp y)) collect (/ x y)))
            :p99 (med with "p99_ms")
            :connect (med with "err_connect") :read (med with "err_read")
            :write (med with "err_write") :timeout (med with "err_timeout")
            :non2xx (med with "non2xx")
            :rss-per-conn (median (loop for r in with
                                        for a = (cell r "rss_idle_kb")
                                        for b = (cell r "rss_before_kb")
                                        for h = (cell r "idle_held")
                                        when (and a b h (plusp h)) collect (/ (- a b) h)))
            :threads-before (med with "threads_before") :threads-idle (med with "threads_idle")
            :note (let ((r (first all-with))) (and r (gethash "note" r)))))))

(defun write-idle-table (out rows servers meta)
  (format out "Each server, freshly started (sleep 0 ms), first gets ~A without idle ~
               connections; then the helper opens N keep-alive connections, makes one ~
               request on each (~A at a time) and holds them open, idle, while the same ~
               wrk load runs again. RSS and threads are read from `/proc/PID/status` (nginx: master ~
               and worker summed) before and after the connections are opened; CPU µs/req is ~
               the server's CPU time during each wrk run divided by its requests, as in the ~
               tables above.~%~%"
          (format nil "`wrk -c100` keep-alive for ~A s" (meta meta "duration_s" "?"))
          (meta meta "idle_batch" "32"))
  (format out "| server | idle N | held | opened in | still open after load | 2xx req/s without | CPU µs/req without | 2xx req/s with | CPU µs/req with | with/without | p99 with | socket errors c/r/w/t | non-2xx | RSS per idle conn | threads before → with idle |~%")
  (format out "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|~%")
  (dolist (server servers)
    (let ((s (idle-summary rows server)))
      (cond ((zerop (getf s :runs)))
            ((zerop (getf s :ok))
             (format out "| ~A | ~A | failed | | | | | | | | | | | | |~%"
                     (server-label server) (fmt-int (getf s :n))))
            (t
             (format out "| ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A | ~A → ~A |~%"
                     (server-label server) (fmt-int (getf s :n)) (fmt-int (getf s :held))
                     (fmt-ms (getf s :open-ms)) (fmt-int (getf s :alive)) (fmt-int (getf s :base-rps))
                     (fmt-us (getf s :base-cpu-us))
                     (fmt-int (getf s :with-rps)) (fmt-us (getf s :with-cpu-us))
                     (fmt-ratio (getf s :ratio))
                     (fmt-ms (getf s :p99)) (fmt-errors s) (fmt-int (getf s :non2xx))
                     (if (getf s :rss-per-conn)
                         (format nil "~,1F KiB" (getf s :rss-per-conn))
                         "–")
                     (fmt-int (getf s :threads-before)) (fmt-int (getf s :threads-idle)))))))
  (terpri out)
  (let ((notes (loop for server in servers
                     for note = (getf (idle-summary rows server) :note)
                     when (and note (plusp (length note)))
                       collect (format nil "~A: ~A" (server-label server) note))))
    (when notes
      (format out "~{- ~A~%~}~%" notes))))

;;; The summary: a table per setup, a line per scenario

(defun scenario-short-title (row)
  "ROW's scenario in a few words, e.g. \"0 ms, keep-alive, c10\"."
  (format nil "~D ms, ~A, c~D~:[~;, CPU hog~]"
          (round (or (cell row "sleep_ms") 0))
          (if (string= (gethash "connection" row) "close") "close" "keep-alive")
          (round (or (cell row "connections") 0))
          (hog-scenario-p (gethash "scenario" row))))

(defun troubled-p (s)
  "True when the medians of summary S count socket errors or non-2xx answers."
  (some (lambda (key) (let ((x (getf s key))) (and x (plusp x))))
        '(:connect :read :write :timeout :non2xx)))

(defun summary-cell (s)
  "Summary S as one cell: 2xx req/s, the CPU µs per request in parentheses,
* when its medians count errors, and how many runs succeeded when not all."
  (cond ((zerop (getf s :runs)) "")
        ((zerop (getf s :ok)) (format nil "failed (0/~D)" (getf s :runs)))
        (t (format nil "~A (~A)~:[~;*~]~:[~*~; ~A~]"
                   (fmt-int (getf s :ok-rps)) (fmt-us (getf s :cpu-us))
                   (troubled-p s)
                   (< (getf s :ok) (getf s :runs))
                   (format nil "~D/~D ok" (getf s :ok) (getf s :runs))))))

(defun reference-servers (servers)
  "The servers of SERVERS the others are compared with: stock Hunchentoot and nginx."
  (remove-if-not (lambda (s) (member s '("stock" "nginx") :test #'string=)) servers))

(defun ratio-cell (s refs)
  "Summary S's 2xx req/s over that of each summary in REFS, as \"A / B\"."
  (format nil "~{~A~^ / ~}"
          (mapcar (lambda (r)
                    (let ((x (getf s :ok-rps)) (y (getf r :ok-rps)))
                      (if (and x y (plusp y) (plusp (getf s :ok)) (plusp (getf r :ok)))
                          (fmt-ratio (/ x y))
                          "–")))
                  refs)))

(defun write-summary-table (out rows servers)
  "A line per scenario of ROWS (one setup; CPU-hog scenarios aside): each
server's SUMMARY-CELL, then each Gallop front end's 2xx req/s over stock
Hunchentoot's and over nginx's."
  (let* ((refs (reference-servers servers))
         (compared (and refs (remove-if (lambda (s) (member s refs :test #'string=)) servers))))
    (format out "| scenario |~{ ~A |~}~{ ~A |~}~%"
            (mapcar #'server-short-label servers)
            (mapcar (lambda (c)
                      (format nil "~A ÷ ~{~A~^ / ~}" (server-short-label c) (mapcar #'server-short-label refs)))
                    compared))
    (format out "|---|~{~A~}~%" (make-list (+ (length servers) (length compared)) :initial-element "--:|"))
    (dolist (scenario (remove-if #'hog-scenario-p (matrix-scenarios rows)))
      (let ((row (find scenario rows :key (lambda (r) (gethash "scenario" r)) :test #'string=))
            (sums (mapcar (lambda (server) (cons server (summarize (rows-of rows scenario server))))
                          servers)))
        (flet ((sum (server) (cdr (assoc server sums :test #'string=))))
          (format out "| ~A |~{ ~A |~}~{ ~A |~}~%"
                  (scenario-short-title row)
                  (mapcar (lambda (server) (summary-cell (sum server))) servers)
                  (mapcar (lambda (c) (ratio-cell (sum c) (mapcar #'sum refs))) compared)))))
    (terpri out)))

(defun write-hog-summary (out rows servers)
  "A line per CPU-hog scenario (shared): each server's 2xx req/s without and
with the hog, and for Gallop's front ends the pool's threads after the run
with it (median over the repetitions)."
  (let ((shared (rows-in-setup rows "shared")))
    (format out "| scenario |~{ ~A |~}~%" (mapcar #'server-short-label servers))
    (format out "|---|~{~A~}~%" (make-list (length servers) :initial-element "--:|"))
    (dolist (scenario (matrix-scenarios shared))
      (when (hog-scenario-p scenario)
        (let ((row (find scenario shared :key (lambda (r) (gethash "scenario" r)) :test #'string=))
              (base (subseq scenario 0 (- (length scenario) (length "-hog")))))
          (format out "| ~A |~{ ~A |~}~%"
                  (scenario-short-title row)
                  (mapcar (lambda (server)
                            (let ((with (summarize (rows-of shared scenario server)))
                                  (without (summarize (rows-of shared base server)))
                                  ;; Gallop's pool (GALLOP:STATS); the others have none.
                                  (pool (median (loop for r in (rows-of shared scenario server)
                                                      for note = (gethash "note" r)
                                                      for n = (and (row-ok-p r) note
                                                                   (search "run-permits" note)
                                                                   (pool-threads-in-note note))
                                                      when n collect n))))
                              (cond ((zerop (getf with :runs)) "")
                                    ((zerop (getf with :ok)) "failed")
                                    (t (format nil "~A → ~A~@[, pool ~A~]"
                                               (fmt-int (getf without :ok-rps)) (fmt-int (getf with :ok-rps))
                                               (and pool (fmt-int pool)))))))
                          servers)))))
    (terpri out)))

(defun write-idle-summary (out rows servers meta)
  "The idle-connections scenario, a line per server."
  (format out "Each server, freshly started, gets `wrk -c100` keep-alive (sleep 0 ms) for ~A s; ~
               then a helper opens N keep-alive connections (~A at a time, one request on each), ~
               holds them idle, and the same load runs again. RSS and threads from ~
               `/proc/PID/status` (nginx: master and worker summed).~%~%"
          (meta meta "duration_s" "?") (meta meta "idle_batch" "32"))
  (format out "| server | idle held of N | still open after | 2xx req/s without → with | CPU µs/req without → with | p99 with | socket errors c/r/w/t | non-2xx | RSS per idle conn | threads before → with |~%")
  (format out "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|~%")
  (dolist (server servers)
    (let ((s (idle-summary rows server)))
      (cond ((zerop (getf s :runs)))
            ((zerop (getf s :ok))
             (format out "| ~A | failed (N = ~A) | | | | | | | | |~%"
                     (server-label server) (fmt-int (getf s :n))))
            (t
             (format out "| ~A | ~A of ~A | ~A | ~A → ~A (~A) | ~A → ~A | ~A | ~A | ~A | ~A | ~A → ~A |~%"
                     (server-label server) (fmt-int (getf s :held)) (fmt-int (getf s :n))
                     (fmt-int (getf s :alive))
                     (fmt-int (getf s :base-rps)) (fmt-int (getf s :with-rps)) (fmt-ratio (getf s :ratio))
                     (fmt-us (getf s :base-cpu-us)) (fmt-us (getf s :with-cpu-us))
                     (fmt-ms (getf s :p99)) (fmt-errors s) (fmt-int (getf s :non2xx))
                     (if (getf s :rss-per-conn) (format nil "~,1F KiB" (getf s :rss-per-conn)) "–")
                     (fmt-int (getf s :threads-before)) (fmt-int (getf s :threads-idle)))))))
  (terpri out)
  ;; Notes other than Gallop's pool counters (those are in the run's report).
  (let ((notes (loop for server in servers
                     for note = (getf (idle-summary rows server) :note)
                     when (and note (plusp (length note)) (not (search "run-permits" note)))
                       collect (format nil "~A: ~A" (server-label server) note))))
    (when notes
      (format out "~{- ~A~%~}~%" notes))))

;;; How the run was done

(defun text-lines (text)
  "TEXT's lines, without the empty ones at its end."
  (split (string-right-trim '(#\Newline) text) #\Newline))

(defun diff-lines (a b)
  "Lines A and B (lists of strings) merged along their longest common
subsequence: a list of (:BOTH . LINE), (:A . LINE) and (:B . LINE) in order,
where A and B differ their lines taken in turn."
  (let* ((va (coerce a 'vector)) (vb (coerce b 'vector))
         (n (length va)) (m (length vb))
         ;; LCS (i, j): the length of the longest common subsequence of A
         ;; from line I and B from line J.
         (lcs (make-array (list (1+ n) (1+ m)) :initial-element 0))
         (out '()) (as '()) (bs '()) (i 0) (j 0))
    (loop for x from (1- n) downto 0
          do (loop for y from (1- m) downto 0
                   do (setf (aref lcs x y)
                            (if (string= (aref va x) (aref vb y))
                                (1+ (aref lcs (1+ x) (1+ y)))
                                (max (aref lcs (1+ x) y) (aref lcs x (1+ y)))))))
    (flet ((flush ()
             ;; The k-th line of A's run beside the k-th of B's: a command
             ;; and its other setup's form stay together.
             (loop for a-lines = (reverse as) then (rest a-lines)
                   for b-lines = (reverse bs) then (rest b-lines)
                   while (or a-lines b-lines)
                   do (when a-lines (push (cons :a (first a-lines)) out))
                      (when b-lines (push (cons :b (first b-lines)) out)))
             (setf as '() bs '())))
      (loop while (or (< i n) (< j m))
            do (cond ((and (< i n) (< j m) (string= (aref va i) (aref vb j)))
                      (flush)
                      (push (cons :both (aref va i)) out)
                      (incf i) (incf j))
                     ((and (< i n) (or (= j m) (>= (aref lcs (1+ i) j) (aref lcs i (1+ j)))))
                      (push (aref va i) as) (incf i))
                     (t (push (aref vb j) bs) (incf j))))
      (flush))
    (nreverse out)))

(defun mark-line (line setup)
  "LINE (of a shell script or nginx.conf) marked as SETUP's alone: a comment
with \"[SETUP]\" after its #, anything else with a trailing comment."
  (let* ((indent (or (position #\Space line :test-not #'char=) 0))
         (rest (subseq line indent)))
    (if (uiop:string-prefix-p "#" rest)
        (format nil "~A# [~A]~A" (subseq line 0 indent) setup (subseq rest 1))
        (format nil "~A  # [~A]" line setup))))

(defun merged-setup-text (meta key setups)
  "META's KEY (commands or nginx.conf) for SETUPS written once: the lines the
setups share as they are, the others marked with their setup (MARK-LINE)."
  (flet ((text (setup) (text-lines (setup-meta meta key setup "?"))))
    (format nil "~{~A~%~}"
            (if (rest setups)
                (loop for (side . line) in (diff-lines (text (first setups)) (text (second setups)))
                      collect (ecase side
                                (:both line)
                                (:a (mark-line line (first setups)))
                                (:b (mark-line line (second setups)))))
                (text (first setups))))))

(defun write-method (out meta setups rows &key report-name)
  "How the run of META and ROWS was done, its SETUPS' CPU policies, exact
commands and nginx.conf; only the servers and scenarios ROWS hold.  With
REPORT-NAME, the run's whole report, a link to it stands in for the
commands and nginx.conf, which that report has (BENCHMARKS.md stays short)."
  (format out "### How it was run~%~%")
  (format out "- Machine: ~A, ~A cores, ~A RAM; ~A, Linux ~A.~%"
          (meta meta "cpu" "?") (meta meta "cores" "?") (meta meta "memory" "?")
          (meta meta "os" "?") (meta meta "kernel" "?"))
  (format out "- Software: SBCL ~A; Hunchentoot ~A (Debian); ~A; ~A; Gallop ~A.~%"
          (meta meta "sbcl" "?") (meta meta "hunchentoot" "?") (meta meta "nginx" "?")
          (meta meta "wrk" "?") (meta meta "gallop" "?"))
  (format out "- Run `~A` (~A): ~A repetition~:P, ~A s per wrk run, medians over ~
               repetitions; started ~A, took ~A.~%"
          (meta meta "run_id" "?") (meta meta "mode" "?")
          (parse-integer (meta meta "reps" "1") :junk-allowed t)
          (meta meta "duration_s" "?") (meta meta "started" "?") (meta meta "elapsed" "?"))
  (let ((sleeps (sort (remove-duplicates
                        (loop for r in rows
                              unless (member (gethash "scenario" r) '("idle" "idle-base") :test #'string=)
                                collect (round (or (cell r "sleep_ms") 0))))
                       #'<))
        (warmup (parse-integer (meta meta "warmup_s" "0") :junk-allowed t)))
    (format out "- Order: every repetition runs ~:[the~;each~] setup~:*~:[~;, one after the other~], ~
                 and in it every scenario against every server, ~
                 rotating the server order from one scenario to the next, so slow drifts ~
                 of the machine spread over all servers. Each repetition starts fresh ~
                 server processes for the sleep ~{~D~^ and ~} ms scenarios~:[~;, once for each ~
                 sleep,~]~:[~*~; and again for each server's idle-connections scenario (~A setup)~]~A.~%"
            (rest setups) sleeps (rest sleeps)
            (find "idle" rows :key (lambda (r) (gethash "scenario" r)) :test #'string=)
            (first setups)
            (if (and warmup (plusp warmup))
                (format nil "; each freshly started server first gets a ~D s `wrk -c10` warm-up, not recorded" warmup)
                "; no warm-up")))
  (format out "- CPU µs/req: the CPU time the server used during the wrk run (utime + stime ~
               from `/proc/PID/stat`, read just before and just after wrk; nginx: master and ~
               workers summed; a server of two processes: both summed) divided by the ~
               requests wrk completed, whatever their status: what a request costs the ~
               server, also where it is not the bottleneck.~%")
  (format out "- Handler (seed 001): an easy-handler `/yo` returning `\"Hey!\"` ~
               (`\"Hey NAME!\"` with a `name` parameter), which calls `sleep` only ~
               when the sleep setting is above 0.~%")
  (format out "- \"threads\": the most threads the server process had (nginx: master and ~
               workers; two processes: both), sampled from `/proc/PID/status` every 100 ms ~
               during the wrk run.~%")
  (format out "- A run fails (and `make bench*` exits non-zero) when wrk cannot run, ~
               its output cannot be parsed, no response at all arrived, or the server ~
               does not answer `GET /yo` with 200 after the run. Socket errors and ~
               non-2xx answers (e.g. 503) are results, not failures.~%~%")
  (format out "Servers (all on 127.0.0.1, access and message logs off):~%~%")
  (let ((present (servers-present rows)))
    (dolist (d *server-descriptions*)
      (when (member (car d) present :test #'string=)
        (format out "- **~A**: ~A~%" (server-label (car d)) (cdr d)))))
  (format out "~%#### Sharing two cores between load and server~%~%")
  (dolist (setup setups)
    (format out "~A~%~%" (setup-meta meta "cpu_policy" setup "?")))
  (when report-name
    (format out "Exact commands and nginx.conf: [the run's report](~A), \"How it was run\".~%~%"
            report-name)
    (return-from write-method))
  (format out "#### Exact commands~%~%")
  (when (rest setups)
    (format out "Lines marked ~{[~A]~^ or ~} belong to that setup alone.~%~%" setups))
  (format out "```sh~%~A```~%~%" (merged-setup-text meta "commands" setups))
  (format out "nginx.conf (`DIR` is a fresh directory under `bench/results/tmp/`):~%~%```nginx~%~A```~%~%"
          (merged-setup-text meta "nginx_conf" setups)))

;;; The report

(defun write-results (out meta rows &key svg-name report-name (method t) detail)
  "The markdown of the run in META and ROWS: a table per setup with a line per
scenario, the goals, the CPU-hog and idle-connections scenarios, failures
and (METHOD) how the run was done.  With DETAIL, also the setups side by side
and a table per scenario and setup (latency, errors, threads), and the hog
and idle scenarios in full.  SVG-NAME, REPORT-NAME: links to the chart and to
the run's whole report, when given; the link to the report stands in for the
exact commands (WRITE-METHOD)."
  (let ((servers (servers-present rows))
        (setups (setups-present rows)))
    (format out "## Results~%~%")
    (format out "Run `~A` (~A mode) on ~A, ~A cores; SBCL ~A; Gallop ~A. Medians of ~A ~
                 repetition~:P of ~A s wrk runs.~%~%"
            (meta meta "run_id" "?") (meta meta "mode" "?") (meta meta "cpu" "?")
            (meta meta "cores" "?") (meta meta "sbcl" "?") (meta meta "gallop" "?")
            (parse-integer (meta meta "reps" "1") :junk-allowed t)
            (meta meta "duration_s" "?"))
    (format out "A cell is a server's 2xx answers per second, and in parentheses the ~
                 server's CPU µs per request (\"How it was run\"); `*`: its median run had ~
                 socket errors or non-2xx answers. A ratio is one server's 2xx req/s over ~
                 stock Hunchentoot's and over nginx's, in the same setup of the same run. ~
                 Compare servers within a run, by such ratios: the host's speed moves from ~
                 run to run, and moves every server with it.~@[ Latency percentiles, errors ~
                 and threads of every scenario: [the run's report](~A).~]~%~%"
            report-name)
    (format out "Setups (\"Sharing two cores\" below): ~{~A~^; ~}.~%~%"
            (mapcar (lambda (setup)
                      (if (string= setup "shared")
                          "**shared**: nothing pinned, wrk with a thread per core, nginx with a worker per core, as on a real machine"
                          "**pinned**: server on one core, wrk on the other (the cost per core)"))
                    setups))
    (when svg-name
      (format out "![2xx requests per second by scenario and server](~A)~%~%" svg-name))
    (dolist (setup setups)
      (format out "### ~A~%~%" (setup-title setup))
      (write-summary-table out (rows-in-setup rows setup) servers))
    (let ((goals (and (rest setups)
                      (string/= (meta meta "mode" "") "tls")
                      (goal-lines rows meta))))
      (when goals
        (format out "### The goals of the every-core issue, in this run~%~%")
        (format out "Ratios of the tables above, by repetition (repetition i shared against ~
                     repetition i pinned, or against nginx in the same repetition), and their ~
                     median; \"held\" says whether the median meets the goal.~:[~; The ~
                     reference lines are nginx's own ratios in the same run: its shared ÷ ~
                     pinned CPU, how far the host moved that ratio for a server without a ~
                     pool; its c400 ÷ c100 rate, what 400 connections cost the host against ~
                     100 for a server that, like the Lisp servers with a 1 ms handler here, ~
                     is CPU-bound at both.~]~%~%"
                (find "| reference, not a goal" goals :test #'search))
        (format out "| goal | measured (median) | per repetition | held |~%|---|--:|---|---|~%~{~A~%~}~%"
                goals)))
    (when (some #'hog-scenario-p (mapcar (lambda (r) (gethash "scenario" r)) rows))
      (format out "### A CPU hog beside the server (shared)~%~%")
      (format out "The same load with a busy loop on one core for the whole run: another process ~
                   holding a CPU. A pool that took the CPU it cannot get for blocked handlers ~
                   would grow (0 ms); with handlers that do block (1 ms) it must still grow.~:[ ~
                   Each cell: 2xx req/s without → with the busy loop, and for Gallop the ~
                   pool's threads after the run with it.~;~]~%~%"
              detail)
      (if detail
          (write-hog-comparison out rows servers)
          (write-hog-summary out rows servers)))
    (let ((idle (find "idle" rows :key (lambda (r) (gethash "scenario" r)) :test #'string=)))
      (when idle
        (format out "### Idle connections held open while wrk -c100 runs (keep-alive, sleep 0 ms, ~A)~%~%"
                (row-setup idle))
        (if detail
            (write-idle-table out rows servers meta)
            (write-idle-summary out rows servers meta))))
    (when detail
      (when (rest setups)
        (format out "### Every core: pinned and shared~%~%")
        (format out "Each server's cost per request with the server pinned to one core and unpinned ~
                     beside wrk, and its throughput unpinned against nginx's (with a worker per ~
                     core) in the same run.~%~%")
        (write-setup-comparison out rows servers))
      (dolist (setup setups)
        (let ((in-setup (rows-in-setup rows setup)))
          (format out "### Each scenario in the ~A setup~%~%" setup)
          (format out "\"vs stock\" compares 2xx req/s with stock Hunchentoot's; \"±\" is half the ~
                       spread (max − min) over the repetitions.~%~%")
          (dolist (scenario (matrix-scenarios in-setup))
            (let ((row (find scenario in-setup :key (lambda (r) (gethash "scenario" r)) :test #'string=)))
              (format out "#### ~A~%~%" (scenario-title row))
              (write-scenario-table out in-setup scenario servers))))))
    (let ((failed (remove-if #'row-ok-p rows)))
      (when failed
        (format out "### Failed runs~%~%")
        (dolist (r failed)
          (format out "- repetition ~A, ~A, ~A, ~A: ~A~%"
                  (gethash "rep" r) (row-setup r) (gethash "scenario" r)
                  (server-label (gethash "server" r)) (gethash "status" r)))
        (terpri out)))
    (when method
      (write-method out meta setups rows :report-name report-name))))

;;; Chart

(defun chart-rows (rows &key (suffix "") (idle t))
  "Panels of the chart for ROWS (one setup), one row of them per connection
count, titled with SUFFIX; the idle scenario's when IDLE."
  (let* ((servers (servers-present rows))
         (scenarios (remove-if #'hog-scenario-p (matrix-scenarios rows)))
         (by-shape (make-hash-table :test #'equal))
         (shapes '()))
    ;; One row of panels per connection count; columns are sleep x connection mode.
    (dolist (scenario scenarios)
      (let* ((row (find scenario rows :key (lambda (r) (gethash "scenario" r)) :test #'string=))
             (connections (round (or (cell row "connections") 0))))
        (unless (member connections shapes) (setf shapes (append shapes (list connections))))
        (push (list :title (format nil "sleep ~D ms, ~A"
                                   (round (or (cell row "sleep_ms") 0))
                                   (if (string= (gethash "connection" row) "close")
                                       "Connection: close" "keep-alive"))
                    :bars (loop for server in servers
                                for s = (summarize (rows-of rows scenario server))
                                collect (list (server-label server) (getf s :ok-rps)
                                              (if (zerop (getf s :ok)) "failed"
                                                  (fmt-int (getf s :ok-rps)))
                                              (server-color (server-kind server))
                                              (string= server "nginx"))))
              (gethash connections by-shape))))
    (append
     (loop for connections in shapes
           collect (cons (format nil "~D connections~A" connections suffix)
                         (reverse (gethash connections by-shape))))
     (when (and idle (find "idle" rows :key (lambda (r) (gethash "scenario" r)) :test #'string=)
       (let ((summaries (mapcar (lambda (server) (cons server (idle-summary rows server))) servers)))
         (list (list "Idle keep-alive connections held open during wrk -c100, sleep 0 ms"
                     (list :title "2xx req/s without idle conns"
                           :bars (loop for (server . s) in summaries
                                       collect (list (server-label server) (getf s :base-rps)
                                                     (if (getf s :base-rps) (fmt-int (getf s :base-rps)) "n/a")
                                                     (server-color (server-kind server))
                                                     (string= server "nginx"))))
                     (list :title "2xx req/s with N idle conns"
                           :bars (loop for (server . s) in summaries
                                       collect (list (server-label server) (getf s :with-rps)
                                                     (if (getf s :with-rps)
                                                         (format nil "~A (N=~A)" (fmt-int (getf s :with-rps))
                                                                 (fmt-int (getf s :held)))
                                                         "n/a")
                                                     (server-color (server-kind server))
                                                     (string= server "nginx"))))
                     (list :title "RSS per idle conn, KiB (lower is better)"
                           :bars (loop for (server . s) in summaries
                                       for v = (getf s :rss-per-conn)
                                       collect (list (server-label server) (and v (max v 0))
                                                     (if v (format nil "~,1F" v) "n/a")
                                                     (server-color (server-kind server))
                                                     (string= server "nginx"))))))))))))

(defun write-chart (svg-path meta rows)
  (write-svg-chart
   svg-path
   :title "Gallop vs stock Hunchentoot (and nginx): successful requests per second, higher is better"
   :subtitle (format nil "run ~A (~A): median of ~A × ~A s wrk runs, ~A; SBCL ~A; pinned: server on CPU ~A, wrk -t~A on CPU ~A~@[; shared: nothing pinned, wrk -t~A~]; // = bar cut, off the panel's scale"
                     (meta meta "run_id" "?") (meta meta "mode" "?") (meta meta "reps" "?")
                     (meta meta "duration_s" "?") (meta meta "cpu" "?") (meta meta "sbcl" "?")
                     (setup-meta meta "server_cpus" "pinned" "any")
                     (setup-meta meta "wrk_threads" "pinned" "?")
                     (setup-meta meta "client_cpus" "pinned" "any")
                     (meta meta "wrk_threads_shared"))
   :legend (loop for server in (servers-present rows)
                 collect (list (server-label server) (server-color (server-kind server))))
   :rows (let ((setups (setups-present rows)))
           (loop for setup in setups
                 append (chart-rows (rows-in-setup rows setup)
                                    :suffix (if (rest setups) (format nil ", ~A" setup) "")
                                    :idle (string= setup (first setups)))))))

;;; Files

(defparameter *begin-marker* "<!-- bench:begin -->")
(defparameter *end-marker* "<!-- bench:end -->")

(defparameter *intro*
  "# Benchmarks

Gallop's three front ends against stock Hunchentoot, with Debian's nginx as
the reference for what the machine can do. Reproduce with `make bench`.
Everything between the two markers below is generated from the latest full
run by `bench/run.lisp`; edit only outside them.

")

(defun file-string (path)
  (with-open-file (in path :external-format :utf-8)
    (let ((s (make-string (file-length in))))
      (subseq s 0 (read-sequence s in)))))

(defun write-string-to-file (string path)
  (ensure-directories-exist path)
  (with-open-file (out path :direction :output :if-exists :supersede :external-format :utf-8)
    (write-string string out))
  path)

(defun splice-generated (old generated &key (begin-marker *begin-marker*) (end-marker *end-marker*))
  "OLD with the text between BEGIN-MARKER and END-MARKER (by default the
matrix's) replaced by GENERATED (markers kept); OLD plus the markers when it
has none; the intro plus the markers when OLD is NIL."
  (let* ((block (format nil "~A~%<!-- Generated by bench/run.lisp; do not edit between these markers. -->~%~%~A~A~%"
                        begin-marker generated end-marker))
         (begin (and old (search begin-marker old)))
         (end (and begin (search end-marker old :start2 begin))))
    (cond ((null old) (concatenate 'string *intro* block))
          ((and begin end)
           (let ((after (+ end (length end-marker))))
             ;; Drop the newline that ended the old block: BLOCK brings its own.
             (when (and (< after (length old)) (char= (char old after) #\Newline))
               (incf after))
             (concatenate 'string (subseq old 0 begin) block (subseq old after))))
          (t (concatenate 'string old (string #\Newline) block)))))

(defun absolute (path)
  (uiop:ensure-absolute-pathname (pathname path) (uiop:getcwd)))

(defun link-from (path file &key (only-below nil))
  "PATH as a markdown link from FILE: relative when PATH is in FILE's
directory or below it, else absolute (or NIL when ONLY-BELOW)."
  (let* ((path (absolute path))
         (dir (uiop:pathname-directory-pathname (absolute file)))
         (name (enough-namestring path dir)))
    (cond ((uiop:absolute-pathname-p (pathname name)) (and (not only-below) name))
          (t name))))

(defun report (tsv-path &key md svg summary (stream *standard-output*))
  "Write the report of the run in TSV-PATH, each part when its path is given:
the chart to SVG; the whole report (a table per scenario and setup, latency,
errors and threads included) to MD; the summary (a table per setup, a line
per scenario) between the markers of SUMMARY, i.e. BENCHMARKS.md (a new file
gets an intro); the summary's tables without the method to STREAM.  A run
of the many-processes row (make bench-processes) has no chart, and its
summary goes between its own markers (PROCESSES-REPORT)."
  (multiple-value-bind (meta rows) (read-tsv tsv-path)
    (when (string= (meta meta "mode" "") "processes")
      (return-from report (processes-report meta rows :md md :summary summary :stream stream)))
    (when svg (write-chart svg meta rows))
    (when md
      (write-string-to-file
       (format nil "# Gallop benchmarks: ~A run ~A~%~%~A"
               (meta meta "mode" "?") (meta meta "run_id" "?")
               (with-output-to-string (out)
                 ;; The chart only when it sits beside the report (a full run
                 ;; draws it for BENCHMARKS.md alone).
                 (write-results out meta rows :detail t
                                              :svg-name (and svg (link-from svg md :only-below t)))))
       md))
    (when summary
      (let ((generated (with-output-to-string (out)
                         (write-results out meta rows
                                        :svg-name (and svg (link-from svg summary))
                                        :report-name (and md (link-from md summary))))))
        (write-string-to-file
         (splice-generated (and (probe-file summary) (file-string summary)) generated)
         summary)))
    (when stream
      (write-results stream meta rows :method nil)
      (finish-output stream))
    (values md svg summary)))
;;; The many-processes row (make bench-processes)

(defparameter *processes-begin-marker* "<!-- bench-processes:begin -->")
(defparameter *processes-end-marker* "<!-- bench-processes:end -->")

(defparameter *process-pairs*
  '(("native" "native-2p" "`gallop:start`")
    ("gallop" "gallop-2p" "`gallop:easy-acceptor`"))
  "Each Gallop front end of the many-processes row: its server of one
process, its server of several on one port, its label.")

(defun median-ratio (rows scenario a b column)
  "The median over repetitions of server A's COLUMN ÷ server B's in
SCENARIO, each repetition's A against the same repetition's B; NIL when no
repetition has both."
  (median (rep-ratios (rep-values rows scenario a column) (rep-values rows scenario b column))))

(defun processes-ratio-cell (rows scenario a b)
  "A ÷ B in SCENARIO: the median ratio of 2xx req/s, and in parentheses of
CPU µs per request."
  (let ((rate (median-ratio rows scenario a b "ok_rps"))
        (cpu (median-ratio rows scenario a b "cpu_us_per_req")))
    (if rate
        (format nil "~A (~A)" (fmt-ratio rate) (fmt-ratio cpu))
        "–")))

(defun processes-servers-present (rows)
  "The servers of ROWS in the many-processes row's order: each front end in
one process, then in several, then nginx."
  (let ((present (servers-present rows)))
    (remove-if-not (lambda (name) (member name present :test #'string=))
                   (append (loop for (one several) in *process-pairs* append (list one several))
                           (list "nginx")))))

(defun processes-shape (meta rows)
  "How many processes the several-process servers of ROWS have, and how many
workers nginx had (as META records them)."
  (values (let ((pair (find-if (lambda (p) (find (second p) rows :key (lambda (r) (gethash "server" r))
                                                                   :test #'string=))
                               *process-pairs*)))
            (if pair (server-process-count (second pair)) 2))
          (setup-meta meta "nginx_workers" "shared" "?")))

(defun write-processes-table (out meta rows)
  "A line per front end and scenario of the many-processes row: 2xx req/s
and CPU µs per request (SUMMARY-CELL) of one process, of several on one port
and of nginx, and the ratios between them (PROCESSES-RATIO-CELL)."
  (multiple-value-bind (n workers) (processes-shape meta rows)
    (format out "| front end | 0 ms keep-alive | 1 process | ~D processes | nginx, ~A workers | ~D ÷ 1 | ~D ÷ nginx | 1 ÷ nginx |~%"
            n workers n n)
    (format out "|---|--:|--:|--:|--:|--:|--:|--:|~%")
    (dolist (pair *process-pairs*)
      (destructuring-bind (one several label) pair
        (dolist (scenario (matrix-scenarios rows))
          (let ((row (find scenario rows :key (lambda (r) (gethash "scenario" r)) :test #'string=)))
            (when (or (rows-of rows scenario one) (rows-of rows scenario several))
              (format out "| ~A | c~D | ~A | ~A | ~A | ~A | ~A | ~A |~%"
                      label (round (or (cell row "connections") 0))
                      (summary-cell (summarize (rows-of rows scenario one)))
                      (summary-cell (summarize (rows-of rows scenario several)))
                      (summary-cell (summarize (rows-of rows scenario "nginx")))
                      (processes-ratio-cell rows scenario several one)
                      (processes-ratio-cell rows scenario several "nginx")
                      (processes-ratio-cell rows scenario one "nginx")))))))
    (terpri out)))

(defun write-processes-repetitions (out rows)
  "Each ratio of the many-processes table in every repetition: how far one
repetition's ratio strays from the median."
  (format out "| front end | scenario | ratio | 2xx req/s, by repetition | CPU µs/req, by repetition |~%")
  (format out "|---|---|---|---|---|~%")
  (dolist (pair *process-pairs*)
    (destructuring-bind (one several label) pair
      (dolist (scenario (matrix-scenarios rows))
        (loop for (a b) in (list (list several one) (list several "nginx") (list one "nginx"))
              for rates = (rep-ratios (rep-values rows scenario a "ok_rps")
                                      (rep-values rows scenario b "ok_rps"))
              for cpus = (rep-ratios (rep-values rows scenario a "cpu_us_per_req")
                                     (rep-values rows scenario b "cpu_us_per_req"))
              when rates
                do (format out "| ~A | ~A | ~A ÷ ~A | ~{~,2F~^, ~} | ~{~,2F~^, ~} |~%"
                           label scenario (server-short-label a) (server-short-label b)
                           rates cpus)))))
  (terpri out))

(defun write-processes-results (out meta rows &key report-name (method t) detail)
  "The markdown of a many-processes run (META, ROWS): the table, failures,
and (METHOD) how it was run; with DETAIL also every repetition's ratios and
a table per scenario (latency, errors, threads).  REPORT-NAME: a link to
the run's whole report, when given."
  (multiple-value-bind (n workers) (processes-shape meta rows)
    (format out "Run `~A` (~A mode) on ~A, ~A cores; SBCL ~A; Gallop ~A. Medians of ~A ~
                 repetition~:P of ~A s wrk runs, interleaved: every repetition starts every ~
                 server afresh and runs each scenario against each, the order rotated from ~
                 scenario to scenario.~@[ Latency, errors, threads and every repetition's ~
                 ratios: [the run's report](~A).~]~%~%"
            (meta meta "run_id" "?") (meta meta "mode" "?") (meta meta "cpu" "?")
            (meta meta "cores" "?") (meta meta "sbcl" "?") (meta meta "gallop" "?")
            (parse-integer (meta meta "reps" "1") :junk-allowed t)
            (meta meta "duration_s" "?") report-name)
    (format out "Shared setup: nothing pinned, `wrk -t~A` (a thread per core), handler ~
                 sleep 0 ms, keep-alive. \"~D processes\": ~R processes of the front end on ~
                 one port, each bound with `:reuse-port t` (`SO_REUSEPORT`), the kernel ~
                 spreading connections over them; nginx runs ~A worker processes. A cell is ~
                 2xx req/s and, in parentheses, the server's CPU µs per request: utime + ~
                 stime of all its processes summed (nginx: master and workers), over the ~
                 requests wrk completed; `*`: its median run had socket errors or non-2xx ~
                 answers. A ratio is the median over repetitions of each repetition's ratio ~
                 of 2xx req/s, and in parentheses of CPU µs per request (below 1×: cheaper ~
                 per request).~%~%"
            (setup-meta meta "wrk_threads" "shared" "?") n n workers))
  (write-processes-table out meta rows)
  (when detail
    (format out "### Every repetition~%~%")
    (write-processes-repetitions out rows)
    (format out "### Each scenario~%~%")
    (format out "\"vs stock\" is empty: stock Hunchentoot is not in this row. \"±\" is half ~
                 the spread (max − min) over the repetitions.~%~%")
    (dolist (scenario (matrix-scenarios rows))
      (let ((row (find scenario rows :key (lambda (r) (gethash "scenario" r)) :test #'string=)))
        (format out "#### ~A~%~%" (scenario-title row))
        (write-scenario-table out rows scenario (processes-servers-present rows)))))
  (let ((failed (remove-if #'row-ok-p rows)))
    (when failed
      (format out "### Failed runs~%~%")
      (dolist (r failed)
        (format out "- repetition ~A, ~A, ~A: ~A~%"
                (gethash "rep" r) (gethash "scenario" r)
                (server-label (gethash "server" r)) (gethash "status" r)))
      (terpri out)))
  (when method
    (write-method out meta (setups-present rows) rows)))

(defun processes-report (meta rows &key md summary stream)
  "REPORT for a many-processes run (META, ROWS): the whole report to MD, the
table and its text between SUMMARY's bench-processes markers (BENCHMARKS.md;
the rest of the file as it is), the table alone to STREAM."
  (when md
    (write-string-to-file
     (format nil "# Gallop benchmarks: many processes on one port, run ~A~%~%~A"
             (meta meta "run_id" "?")
             (with-output-to-string (out)
               (write-processes-results out meta rows :detail t)))
     md))
  (when summary
    (let ((generated (with-output-to-string (out)
                       (write-processes-results out meta rows
                                                :report-name (and md (link-from md summary))
                                                :method nil))))
      (write-string-to-file
       (splice-generated (and (probe-file summary) (file-string summary)) generated
                         :begin-marker *processes-begin-marker*
                         :end-marker *processes-end-marker*)
       summary)))
  (when stream
    (write-processes-table stream meta rows)
    (finish-output stream))
  (values md nil summary))
