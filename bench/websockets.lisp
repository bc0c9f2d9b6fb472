;;;; websockets.lisp -- `make bench-websockets`: WebSocket servers side by
;;;; side in one run, each in its own process (bench/ws-server.lisp), loaded
;;;; by one client, bench/ws-load.c (compiled here with gcc), on 127.0.0.1:
;;;;
;;;;   native      Gallop's own API (GALLOP:ACCEPT-WEBSOCKET on GALLOP:START)
;;;;   wsd-gallop  websocket-driver under Clack :gallop
;;;;   hs-gallop   hunchensocket on GALLOP:EASY-ACCEPTOR
;;;;   hs-stock    hunchensocket on stock Hunchentoot (the control)
;;;;
;;;; (woo + websocket-driver, the issue's other control, is not run: woo is
;;;; not a Debian package.)  The libraries come from ASDF's source registry.  For each, in turn:
;;;;   - N idle WebSockets (BENCH_WS_N, default 10,000) opened and held: how
;;;;     many opened, the server's threads before and while they are held
;;;;     (and its pool's, for the native one), KiB of RSS each (after a full
;;;;     GC, against the idle server after one), and a fresh plain request's
;;;;     time meanwhile (the median of 5);
;;;;   - echo round trips a second with 100 and 1,000 WebSockets (5 s each);
;;;;   - one message to N WebSockets on /all: ms until the last has it.
;;;; Writes bench/results/STAMP-websockets.md.  Exits non-zero when the native
;;;; server held fewer than N, or used more than its CPUs + 2 pool workers
;;;; for them.

(load (merge-pathnames "process.lisp" (directory-namestring *load-truename*)))

(defpackage #:gallop-bench-websockets
  (:use #:common-lisp #:gallop-bench-process)
  (:export #:main))
(in-package #:gallop-bench-websockets)

(defparameter *n* (env-int "BENCH_WS_N" 10000))
(defparameter *port* 19101)
(defparameter *kinds* (let ((kinds (env "BENCH_WS_KINDS")))
                        (if kinds
                            (uiop:split-string kinds :separator " ")
                            '("native" "wsd-gallop" "hs-gallop" "hs-stock"))))

(defun load-tool ()
  "bench/ws-load.c compiled into bench/results/tmp/ws-load."
  (let ((binary (merge-pathnames "bench/results/tmp/ws-load" *repo*)))
    (ensure-directories-exist binary)
    (uiop:run-program (list "gcc" "-O2" "-o" (namestring binary)
                            (namestring (merge-pathnames "bench/ws-load.c" *repo*)))
                      :output t :error-output t)
    (namestring binary)))

(defun start-server (kind)
  "bench/ws-server.lisp serving KIND on *PORT*: its process and pid."
  (start-bench-server kind *port* :script "bench/ws-server.lisp" :more '() :timeout 600
                                  :log (merge-pathnames (format nil "bench/results/tmp/ws-~A.log" kind)
                                                        *repo*)
                                  :if-log-exists :supersede
                                  :environment (environment-with
                                                (list (format nil "XDG_CACHE_HOME=~A"
                                                              (namestring (merge-pathnames ".cache/clack-ws/"
                                                                                           *repo*)))))))

(defun run-load (tool &rest args)
  "Run the load tool with ARGS to its end: its output line."
  (string-trim '(#\Newline)
               (uiop:run-program (cons tool (mapcar #'princ-to-string args))
                                 :output :string :ignore-error-status t)))

(defun words (line) (uiop:split-string line :separator " "))

(defun plain-ms (port)
  "A fresh GET /plain: milliseconds to its whole answer, or NIL."
  (flet ((us () (multiple-value-bind (s us) (sb-ext:get-time-of-day) (+ (* s 1000000) us))))
    (let* ((start (us))
           (octets (fetch port "/plain")))
      (and octets (search "plain" (map 'string #'code-char octets))
           (/ (- (us) start) 1000.0)))))

(defun cpu-ticks (pid)
  "User + system CPU time of PID so far, in clock ticks (/proc/PID/stat)."
  (let* ((text (uiop:read-file-string (format nil "/proc/~D/stat" pid)))
         (fields (words (string-left-trim " " (subseq text (1+ (position #\) text :from-end t)))))))
    ;; After the command: state is field 3, utime 14 and stime 15.
    (+ (parse-integer (nth 11 fields)) (parse-integer (nth 12 fields)))))

(defun echo-run (tool pid connections)
  "Echo round trips a second with CONNECTIONS WebSockets, and the server's
CPU µs per round trip."
  (let* ((before (cpu-ticks pid))
         (words (words (run-load tool "echo" *port* "/echo" connections 5)))
         (after (cpu-ticks pid))
         (rate (and (equal (first words) "ECHO") (parse-integer (second words)))))
    ;; 100 ticks a second; the load tool's warm-up (0.5 s) counts too.
    (values rate (and rate (plusp rate)
                      (/ (* (- after before) 10000.0) (* rate 5.5))))))

(defun pool-threads (process)
  (getf (ask-stats process) :threads))

(defun measure (tool kind)
  "One server's line of the table, a property list."
  (multiple-value-bind (process pid) (start-server kind)
    (unwind-protect
         (let (base-rss base-threads)
           (ask-process process "gc" "GC" 60)
           (multiple-value-setq (base-rss base-threads) (proc-status pid))
           ;; Idle WebSockets, held
           (let* ((hold (sb-ext:run-program tool (list "hold" (princ-to-string *port*) "/echo"
                                                       (princ-to-string *n*))
                                            :wait nil :input :stream :output :stream))
                  (line (read-line-timeout (sb-ext:process-output hold) 300))
                  (opened (and line (parse-integer (second (words line)) :junk-allowed t))))
             (sleep 1)
             (ask-process process "gc" "GC" 120)
             (multiple-value-bind (rss threads) (proc-status pid)
               (let ((pool (pool-threads process))
                     (http (upper-median (loop repeat 5 collect (plain-ms *port*)))))
                 (ignore-errors (close (sb-ext:process-input hold)))
                 (wait-exit hold 60)
                 (kill-and-reap hold)
                 ;; Until the server let go of them (a thread each, for some).
                 (loop repeat 60
                       until (<= (nth-value 1 (proc-status pid)) (+ base-threads 8))
                       do (sleep 0.5))
                 (sleep 1)
                 (multiple-value-bind (echo-100 cpu-100) (echo-run tool pid 100)
                  (multiple-value-bind (echo-1000 cpu-1000) (echo-run tool pid 1000)
                   (let ((broadcast (words (run-load tool "broadcast" *port* "/all" *n*))))
                   (list :kind kind :opened (or opened 0) :base-threads base-threads
                         :threads threads :pool pool
                         :kib (and opened (plusp opened) rss base-rss
                                   (/ (- rss base-rss) (float opened)))
                         :http http
                         :echo-100 echo-100 :cpu-100 cpu-100
                         :echo-1000 echo-1000 :cpu-1000 cpu-1000
                         :broadcast (and (equal (first broadcast) "BROADCAST")
                                         (format nil "~A ms, ~A" (second broadcast)
                                                 (third broadcast)))))))))))
      (ignore-errors (close (sb-ext:process-input process)))
      (wait-exit process 10)
      (kill-and-reap process))))

(defun quotient (a b) (if (and a b (plusp b)) (format nil "~,2F" (/ a b)) "–"))

(defun table (rows)
  (with-output-to-string (out)
    (format out "| server | idle WebSockets held | threads: before → held (pool) | KiB each | fresh HTTP meanwhile | echo/s c100 (CPU µs each) | echo/s c1000 (CPU µs each) | one message to ~:D |~%" *n*)
    (format out "|---|---|---|---|---|---|---|---|~%")
    (dolist (row rows)
      (format out "| ~A | ~:D of ~:D | ~A → ~A~@[ (~A)~] | ~:[–~;~:*~,1F~] | ~:[–~;~:*~,2F ms~] | ~:[–~;~:*~:D~]~@[ (~,1F)~] | ~:[–~;~:*~:D~]~@[ (~,1F)~] | ~A |~%"
              (getf row :kind) (getf row :opened) *n* (getf row :base-threads) (getf row :threads)
              (getf row :pool) (getf row :kib) (getf row :http) (getf row :echo-100) (getf row :cpu-100)
              (getf row :echo-1000) (getf row :cpu-1000) (or (getf row :broadcast) "–")))
    (format out "| woo + websocket-driver | not run: woo is not a Debian package | | | | | | |~%")
    (let ((native (find "native" rows :key (lambda (r) (getf r :kind)) :test #'string=)))
      (when native
        (format out "~%Native ÷ each: echo rate, and the other's server CPU per round trip ÷ native's (above 1: native does better):~%~%| server | rate c100 | CPU c100 | rate c1000 | CPU c1000 |~%|---|---|---|---|---|~%")
        (dolist (row rows)
          (unless (eq row native)
            (format out "| ~A | ~A | ~A | ~A | ~A |~%" (getf row :kind)
                    (quotient (getf native :echo-100) (getf row :echo-100))
                    (quotient (getf row :cpu-100) (getf native :cpu-100))
                    (quotient (getf native :echo-1000) (getf row :echo-1000))
                    (quotient (getf row :cpu-1000) (getf native :cpu-1000)))))))))

(defun main ()
  (raise-fd-limit)
  (let* ((tool (load-tool))
         (rows (loop for kind in *kinds*
                     collect (handler-case (measure tool kind)
                               (error (e) (format *error-output* "~&~A: ~A~%" kind e)
                                 (list :kind kind :opened 0)))))
         (text (table rows))
         (stamp (multiple-value-bind (s m h d mo y) (decode-universal-time (get-universal-time) 0)
                  (format nil "~D~2,'0D~2,'0D-~2,'0D~2,'0D~2,'0D" y mo d h m s)))
         (file (merge-pathnames (format nil "bench/results/~A-websockets.md" stamp) *repo*)))
    (with-open-file (out file :direction :output :if-exists :supersede)
      (format out "# make bench-websockets, ~A~%~%~A~%Host: ~D CPUs.  Method: bench/websockets.lisp.~%"
              stamp text (usable-cpus)))
    (format t "~&~A~%Written to ~A~%" text (enough-namestring file *repo*))
    (let* ((native (find "native" rows :key (lambda (r) (getf r :kind)) :test #'string=))
           (cpus (usable-cpus))
           (bad (and native (or (< (getf native :opened) *n*)
                                (and (getf native :pool) (> (getf native :pool) (+ cpus 2)))))))
      (uiop:quit (if bad 1 0)))))
