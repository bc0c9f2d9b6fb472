;;;; slow-readers.lisp -- `make bench-slow-readers`: clients that never read
;;;; their answers, against each server in its own process (issue 18).
;;;;
;;;; For each server kind (native = GALLOP:START, gallop = GALLOP:EASY-ACCEPTOR,
;;;; stock = Hunchentoot's own, for comparison; BENCH_SLOW_KINDS lists the
;;;; ones to run), with the default pool, after one warm-up request each for
;;;; /yo and /big:
;;;;  - 1,000 clients from this process, each with a 4 KiB receive buffer,
;;;;    pipeline "GET /yo" for PIPELINE-SECONDS as fast as their sockets take
;;;;    it and never read an answer;
;;;;  - at the same time `slowhttptest -X` (slow read: 500 connections asking
;;;;    /big, 1 MiB, three times each, reading 32 octets a second through a
;;;;    window of 512 to 1024 octets);
;;;;  - a fresh client every 200 ms sends one GET /yo with Connection: close
;;;;    and must get exactly "Hey!" (status 200, Content-Length 4), within
;;;;    10 s, all along and for HOLD-SECONDS after the pipelining stops while
;;;;    the 1,000 stay connected;
;;;;  - the server's pool threads (GALLOP:STATS) and process threads and RSS
;;;;    (/proc) are sampled every 250 ms.
;;;; Prints one table row per server and exits non-zero when a Gallop server
;;;; failed a fresh client or answered one in 50 ms or more, grew past its standby threads + 4 pool threads,
;;;; or rose more than 64 MB in RSS.  Traffic goes to 127.0.0.1 only.

(load (merge-pathnames "process.lisp" (directory-namestring *load-truename*)))

(defpackage #:gallop-bench-slow-readers
  (:use #:common-lisp #:gallop-bench-process)
  (:export #:main))
(in-package #:gallop-bench-slow-readers)

(require :sb-bsd-sockets)

(defparameter *clients* (env-int "BENCH_SLOW_CLIENTS" 1000))
(defparameter *pipeline-seconds* (env-int "BENCH_SLOW_SECONDS" 6))
(defparameter *hold-seconds* 4)
(defparameter *standby* 4 "The default pool's standby threads.")
(defparameter *kinds* (uiop:split-string (or (env "BENCH_SLOW_KINDS") "native gallop stock"))
  "The servers to run, in order.")
(defparameter *goal-ms* 50 "A fresh client's answer must take less than this.")

(defparameter *requests*
  (ascii (apply #'concatenate 'string
                (loop repeat 64 collect (format nil "GET /yo HTTP/1.1~C~CHost: b~C~C~C~C"
                                                #\Return #\Linefeed #\Return #\Linefeed
                                                #\Return #\Linefeed))))
  "64 pipelined requests, sent over and over.")

(defun slow-socket (port)
  (let ((s (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (setf (sb-bsd-sockets:sockopt-receive-buffer s) 4096)
    (sb-bsd-sockets:socket-connect s #(127 0 0 1) port)
    (setf (sb-bsd-sockets:non-blocking-mode s) t)
    s))

(defun pipeline (sockets seconds)
  "Send *REQUESTS* on every socket, round after round, as far as each takes
it, for SECONDS.  Returns the octets sent."
  (let ((positions (make-array (length sockets) :initial-element 0))
        (end (+ (now-ms) (* 1000 seconds)))
        (total 0)
        (n (length *requests*)))
    (loop while (< (now-ms) end)
          do (loop for s across sockets
                   for i from 0
                   do (loop
                        (let* ((pos (aref positions i))
                               (sent (ignore-errors
                                      (sb-bsd-sockets:socket-send
                                       s (subseq *requests* pos) nil))))
                          (if (and sent (plusp sent))
                              (progn (incf total sent)
                                     (setf (aref positions i) (mod (+ pos sent) n)))
                              (return)))))
             (sleep 0.05))
    total))

(defun pool-threads (process)
  (getf (ask-stats process) :threads))

(defun warm-up (port)
  "One request for /yo and one for /big before the clients come: the first
request a fresh SBCL process serves through Hunchentoot takes 100 to 150 ms
here (its generic functions' dispatch is computed and compiled on first
call; 0.5 ms after), on every server kind.  That is start-up, not what a
slow reader does to the others."
  (fetch port "/yo")
  (fetch port "/big"))

(defun run-kind (kind port)
  (multiple-value-bind (process pid)
      (start-bench-server kind port :log (merge-pathnames (format nil "bench/results/tmp/slow-readers-~A.log" kind)
                                                          *repo*)
                                    :if-log-exists :supersede)
    (unwind-protect
         (let* ((rss-before (progn (warm-up port) (proc-field pid "VmRSS")))
                (lock (sb-thread:make-mutex))
                (done nil) (latencies '()) (failures 0)
                (peak-pool 0) (peak-threads 0) (peak-rss 0)
                (slowhttptest (sb-ext:run-program
                               "slowhttptest"
                               (list "-X" "-c" "500" "-r" "500" "-l" (princ-to-string (+ *pipeline-seconds* *hold-seconds*))
                                     "-k" "3" "-n" "1" "-w" "512" "-y" "1024" "-z" "32" "-p" "3"
                                     "-u" (format nil "http://127.0.0.1:~D/big" port))
                               :search t :wait nil :output nil :error nil))
                (prober (sb-thread:make-thread
                         (lambda ()
                           (loop until done
                                 do (let ((ms (probe-yo port)))
                                      (sb-thread:with-mutex (lock)
                                        (if ms (push ms latencies) (incf failures))))
                                    (sleep 0.2)))))
                (monitor (sb-thread:make-thread
                          (lambda ()
                            (loop until done
                                  do (let ((pool (and (not (string= kind "stock")) (pool-threads process)))
                                           (threads (proc-field pid "Threads"))
                                           (rss (proc-field pid "VmRSS")))
                                       (setf peak-pool (max peak-pool (or pool 0))
                                             peak-threads (max peak-threads (or threads 0))
                                             peak-rss (max peak-rss (or rss 0))))
                                     (sleep 0.25)))))
                (sockets (coerce (loop repeat *clients* collect (slow-socket port)) 'vector))
                (sent (pipeline sockets *pipeline-seconds*)))
           (sleep *hold-seconds*)
           (setf done t)
           (sb-thread:join-thread prober)
           (sb-thread:join-thread monitor)
           (loop for s across sockets do (ignore-errors (sb-bsd-sockets:socket-close s)))
           (kill-and-reap slowhttptest)
           (let ((row (list :kind kind :probes (+ failures (length latencies)) :failed failures
                            :median-ms (upper-median latencies 0) :max-ms (reduce #'max latencies :initial-value 0)
                            :slow (count-if (lambda (ms) (>= ms *goal-ms*)) latencies)
                            :peak-pool-threads peak-pool :peak-threads peak-threads
                            :rss-before-mb (round (or rss-before 0) 1024) :rss-rise-mb (round (- peak-rss (or rss-before 0)) 1024)
                            :pipelined-mb (round sent (* 1024 1024)))))
             (format t "~&| ~A | ~D | ~D | ~D | ~D | ~D | ~D | ~D | ~D | +~D | ~D |~%"
                     kind (getf row :probes) failures (getf row :slow) (getf row :median-ms) (getf row :max-ms)
                     peak-pool peak-threads (getf row :rss-before-mb) (getf row :rss-rise-mb)
                     (getf row :pipelined-mb))
             (finish-output)
             row))
      (kill-and-reap process))))

(defun main ()
  (raise-fd-limit)
  (ensure-directories-exist (merge-pathnames "bench/results/tmp/" *repo*))
  (format t "~&~D clients pipelining GET /yo for ~D s and never reading, plus slowhttptest -X (500 connections, /big); ~
             a fresh GET /yo every 200 ms until ~D s after.~%~%"
          *clients* *pipeline-seconds* *hold-seconds*)
  (format t "| server | fresh clients | failed | over ~D ms | median ms | max ms | peak pool threads | peak process threads | RSS before MB | RSS rise MB | pipelined MB |~%"
          *goal-ms*)
  (format t "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|~%")
  (let ((bad nil))
    (loop for kind in *kinds*
          for port = (+ 18431 (or (position kind '("native" "gallop" "stock") :test #'string=) 3))
          do (let ((row (run-kind kind port)))
               (when (and (not (string= kind "stock"))
                          (or (plusp (getf row :failed))
                              (plusp (getf row :slow))
                              (> (getf row :peak-pool-threads) (+ *standby* 4))
                              (> (getf row :rss-rise-mb) 64)))
                 (setf bad t))))
    (uiop:quit (if bad 1 0))))
