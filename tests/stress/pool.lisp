;;;; pool.lisp -- the pool's size under load: beside a CPU hog, under a CPU
;;;; quota, with blocked handlers, growing for 200 concurrent sleepers and
;;;; shrinking back; threads that rest switch rarely.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the pool's maker thread
;;;; and its rest, the wheel's rest and the housekeeper thread
;;;; (pool/pool.lisp, timers/wheel.lisp, engine.lisp): that the core's own
;;;; threads rest when the server is idle is what is tested.

(in-package #:gallop-tests)

(in-suite stress)

;;; A CPU hog beside an unpinned server under load

(defun wrk-report (output)
  "From wrk's OUTPUT: the requests it completed, and whether any socket error
or non-2xx answer was reported."
  (let ((completed (let ((at (search " requests in" output)))
                     (and at (parse-integer output :start (1+ (or (position #\Space output :end at :from-end t) -1))
                                                   :end at :junk-allowed t)))))
    (values completed
            (or (search "Socket errors" output) (search "Non-2xx" output)))))

(defun hog-beside-load (kind &key (hog-p t))
  "Serve KIND unpinned, run wrk -t2 -c100 for 10 s against it, with a busy
loop pinned to the last CPU if HOG-P (else it is the control), sampling the
pool every 100 ms.  Returns the most workers and run permits seen, wrk's
completed requests, whether wrk saw errors, the pool after the load, and a
fresh client's answer after it."
  (let* ((port (free-port))
         (server (multiple-value-bind (process ready) (start-bench-server kind port)
                   (unless (uiop:string-prefix-p "READY " ready)
                     (stop-limited-server process)
                     (error "The ~A server did not start: ~S" kind ready))
                   process))
         (hog nil))
    (unwind-protect
         (let* ((most-threads 0) (most-permits 0) (done nil)
                (sampler (sb-thread:make-thread
                          (lambda ()
                            (loop until done
                                  do (let ((stats (limited-server-stats server)))
                                       (setf most-threads (max most-threads (getf stats :threads 0))
                                             most-permits (max most-permits (getf stats :run-permits 0))))
                                     (sleep 0.1)))
                          :name "pool sampler (test)")))
           (when hog-p
             (setf hog (sb-ext:run-program "taskset" (list "-c" (princ-to-string (1- (cpu-count-usable)))
                                                         "sh" "-c" "while :; do :; done")
                                           :search t :wait nil)))
           (let ((output (with-output-to-string (out)
                           (sb-ext:run-program "wrk" (list "-t2" "-c100" "-d10s" "--timeout" "5s"
                                                           (format nil "http://127.0.0.1:~D/yo" port))
                                               :search t :output out :error out))))
             (setf done t)
             (sb-thread:join-thread sampler)
             (when hog
               (sb-ext:process-kill hog 9)
               (sb-ext:process-wait hog))
             (multiple-value-bind (completed errors) (wrk-report output)
               (values most-threads most-permits completed errors
                       (limited-server-stats server) (strict-get port "/yo")
                       output))))
      (when (and hog (sb-ext:process-alive-p hog))
        (sb-ext:process-kill hog 9)
        (sb-ext:process-wait hog))
      (stop-limited-server server))))

(test non-blocking-handlers-beside-a-cpu-hog-do-not-grow-the-pool
  "10 s of unpinned wrk load with a busy loop on one CPU: the workers wait
for CPUs another process holds, which is contention, not blocking.  The
control is the same load on the same kind of server without the busy loop,
in the same run: beside the hog the pool takes at most 2 more workers and
run permits than the control did (permits grow only for workers seen
blocked, and a worker waiting for a CPU is not); every request is served,
on both front ends."
  (let ((cpus (cpu-count-usable)))
    (dolist (kind '("native" "gallop"))
      (multiple-value-bind (control-threads control-permits)
          (hog-beside-load kind :hog-p nil)
        (multiple-value-bind (threads permits completed errors after answer output)
            (hog-beside-load kind)
          (format t "~&    ~A: peak workers / run permits: ~D / ~D alone, ~D / ~D beside a CPU hog~%"
                  kind control-threads control-permits threads permits)
          ;; Gallop's standby count (4) is the floor of the pool's threads.
          (is (<= threads (+ control-threads 2))
              "~A: the pool grew to ~D workers beside a CPU hog (~D alone, ~D CPUs)"
              kind threads control-threads cpus)
          (is (<= permits (+ control-permits 2))
              "~A: the pool took ~D run permits beside a CPU hog (~D alone, ~D CPUs)"
              kind permits control-permits cpus)
          (is (and completed (plusp completed)) "~A: wrk completed nothing: ~A" kind output)
          (is (not errors) "~A: wrk saw errors: ~A" kind output)
          (is (<= (getf after :threads 0) (+ control-threads 2)) "~A: after the load: ~S" kind after)
          (is (exact-answer-p answer "Hey!") "~A: after the load: ~A" kind answer))))))

;;; A CPU quota (cgroup) the pool must count

(defun make-quota-cgroup (name fraction)
  "Create a cgroup NAME limited to FRACTION of a CPU (cgroup v1's cpu
controller, or v2); its directory, or NIL if this machine does not let us."
  (ignore-errors
   (flet ((put (path value)
            (with-open-file (out path :direction :output :if-exists :append)
              (write-line value out))))
     (let ((v1 "/sys/fs/cgroup/cpu/")
           (v2 "/sys/fs/cgroup/"))
       (cond ((probe-file (concatenate 'string v1 "cpu.cfs_quota_us"))
              (let ((dir (concatenate 'string v1 name "/")))
                (ensure-directories-exist dir)
                (put (concatenate 'string dir "cpu.cfs_period_us") "10000")
                (put (concatenate 'string dir "cpu.cfs_quota_us")
                     (princ-to-string (round (* fraction 10000))))
                dir))
             ((probe-file (concatenate 'string v2 "cgroup.controllers"))
              (let ((dir (concatenate 'string v2 name "/")))
                (put (concatenate 'string v2 "cgroup.subtree_control") "+cpu")
                (ensure-directories-exist dir)
                (put (concatenate 'string dir "cpu.max")
                     (format nil "~D 10000" (round (* fraction 10000))))
                dir)))))))

(defun move-to-cgroup (dir pid)
  (with-open-file (out (concatenate 'string dir "cgroup.procs") :direction :output
                                                                 :if-exists :append)
    (format out "~D~%" pid)))

(defun remove-cgroup (dir)
  (ignore-errors
   (sb-posix:rmdir (string-right-trim "/" dir))))

(test pool-under-a-cpu-quota-does-not-grow-when-saturated
  (let ((cgroup (make-quota-cgroup (format nil "gallop-test-~D" (sb-posix:getpid)) 1/5)))
    (if (null cgroup)
        (skip "No writable cgroup cpu controller on this machine.")
        (let ((port (free-port)))
         (multiple-value-bind (server ready) (start-bench-server "native" port)
          (unwind-protect
               (let ((pid (ignore-errors (parse-integer ready :start (length "READY ")))))
                 (is (integerp pid) "the server said ~S" ready)
                 (move-to-cgroup cgroup pid)
                 ;; The pool reads its CPUs again once a second.
                 (sleep 1.5)
                 (let* ((before (getf (limited-server-stats server) :threads))
                        (stop (+ (get-internal-real-time) (* 3 internal-time-units-per-second)))
                        (answered (list 0))
                        (clients
                          (loop repeat 8
                                collect (bt:make-thread
                                         (lambda ()
                                           (let ((s (connect port)))
                                             (unwind-protect
                                                  (loop while (< (get-internal-real-time) stop)
                                                        do (send s (crlf "GET /yo HTTP/1.1" "Host: x"))
                                                           (when (eql 200 (response-status (read-response s)))
                                                             (sb-ext:atomic-incf (car answered))))
                                               (usocket:socket-close s)))))))
                        (peak (sample-max (lambda () (getf (limited-server-stats server) :threads))
                                          (lambda () (notany #'bt:thread-alive-p clients)))))
                   (mapc #'bt:join-thread clients)
                   (is (plusp (car answered)))
                   ;; Saturated, not blocked: no thread beyond those it had.
                   (is (<= peak (+ before 1))
                       "the pool grew from ~D to ~D threads under a CPU quota" before peak)))
            (stop-limited-server server)
            (remove-cgroup cgroup)))))))

;;; Growing under load and shrinking back

(test two-hundred-concurrent-connections-grow-then-shrink-the-pool
  (with-globals ((*sleep-seconds* 0.3))
    (with-server (server 'gallop:easy-acceptor
                         :taskmaster (make-instance 'gallop:taskmaster
                                                    :max-thread-count 64
                                                    :standby-thread-count 2
                                                    :thread-idle-timeout 1))
      (is (= 2 (stat server :threads)))
      (let* ((sockets (open-requests (port-of server) 200 "/sleep"))
             (responses nil)
             (reader (sb-thread:make-thread
                      (lambda () (setf responses (read-all-responses sockets)))))
             (peak (sample-max (lambda () (stat server :threads))
                               (lambda () (not (sb-thread:thread-alive-p reader))))))
        (sb-thread:join-thread reader)
        (is (= 200 (count-if (lambda (r) (and (response-p r) (= 200 (response-status r))
                                              (string= "slept" (body-string r))))
                             responses)))
        ;; The pool grew under load, within its bound ...
        (is (< 8 peak))
        (is (<= peak 64))
        ;; ... and shrinks back to the standby count once idle.
        (is (wait-until (lambda () (= 2 (stat server :threads))) :timeout 20))))))

;;; Blocked handlers: the pool grows for them and shrinks back

(test blocked-handlers-grow-the-pool-and-it-shrinks-back-native
  "BLOCKED-HANDLERS-STALL-NO-OTHER-CONNECTION-NATIVE with the pool's side:
run permits past the CPU count while more handlers block than there are
CPUs, back to one per CPU and to the standby threads after."
  (with-app (server #'gate-app :standby-thread-count 2 :thread-idle-timeout 1)
    (blocked-handlers-case (native-port server) (lambda () (gallop:stats server)) :pool t)))

(test blocked-handlers-grow-the-pool-and-it-shrinks-back-easy-acceptor
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster
                                                  :standby-thread-count 2
                                                  :thread-idle-timeout 1))
    (blocked-handlers-case (port-of server) (lambda () (gallop:stats server)) :pool t)))

;;; Threads that rest switch rarely

(test resting-threads-switch-rarely
  "With nothing to do, the pool's maker stops sampling (pool/maker.lisp, RESTING)
and the housekeeper stops ticking ten times a second (wheel.lisp, RESTING).
Sampling, the maker would switch about 200 times a second; ticking, the
housekeeper about 10: resting, each switches a few times at most."
  (with-app (server #'gate-app :standby-thread-count 2 :thread-idle-timeout 1)
    (let* ((engine (gallop::server-engine server))
           (pool (gallop.core:engine-pool engine)))
      (is (exact-answer-p (strict-get (native-port server) "/yo") "Hey!"))
      (is-true (wait-until (lambda () (and (gallop.core::pool-maker-resting pool)
                                           (gallop.core::wheel-resting
                                            (gallop.core::engine-wheel engine))))
                           :timeout 10)
               "the maker or the housekeeper never rested")
      (let ((maker (switches-during (gallop.core::pool-maker pool) 2))
            (keeper (switches-during (gallop.core::engine-housekeeper engine) 2)))
        (is (< maker 40) "the resting maker switched ~D times in two seconds" maker)
        (is (< keeper 8) "the resting housekeeper switched ~D times in two seconds" keeper)))))

;;; A pool with nothing to do: the maker rests

(test a-resting-maker-sleeps-and-wakes-for-blocked-handlers
  "With no work, the pool's maker stops sampling (pool/maker.lisp, RESTING): it
wakes about once a second instead of every 5 ms.  Work wakes it: handlers
that block, more than there are CPUs, are still served, and it rests again
after.  (How rarely it switches while resting: RESTING-THREADS-SWITCH-RARELY.)"
  (with-app (server #'gate-app :standby-thread-count 2 :thread-idle-timeout 1)
    (let ((pool (gallop.core:engine-pool (gallop::server-engine server))))
      (is (exact-answer-p (strict-get (native-port server) "/yo") "Hey!"))
      (is-true (wait-until (lambda () (gallop.core::pool-maker-resting pool)) :timeout 10)
               "the maker never rested")
      (is-true (gallop.core::pool-maker-resting pool))
      (blocked-handlers-case (native-port server) (lambda () (gallop:stats server)) :pool t)
      (is-true (wait-until (lambda () (gallop.core::pool-maker-resting pool)) :timeout 10)
               "the maker did not rest again"))))
