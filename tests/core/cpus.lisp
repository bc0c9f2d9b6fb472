;;;; cpus.lisp -- the CPUs the pool may use, and how it reads its workers:
;;;; the readers of /proc/self/cgroup and of the quota files on sample texts,
;;;; the runnable state of real threads, the idle time of the CPUs, and the
;;;; maker's rules on recorded inputs.  (A server saturated under a cgroup
;;;; quota: tests/stress/pool.lisp.)
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the readers of
;;;; os/cpus.lisp and the pool's groups, workers and load history
;;;; (pool/maker.lisp): pure functions and the records the maker reads, driven
;;;; with sample inputs.

(in-package #:gallop-tests)

(in-suite core)

(test cgroup-files-are-read-as-the-kernel-writes-them
  (multiple-value-bind (v2 v1)
      (gallop.core::cgroup-paths (format nil "12:pids:/a~%4:cpu,cpuacct:/docker/abc~%0::/user.slice/x~%"))
    (is (equal "/user.slice/x" v2))
    (is (equal "/docker/abc" v1)))
  (multiple-value-bind (v2 v1) (gallop.core::cgroup-paths (format nil "1:cpu:/~%2:cpuset:/z~%"))
    (is (null v2))
    (is (equal "/" v1)))
  (is (equal '("/a/b" "/a" "") (gallop.core::path-ancestors "/a/b/")))
  (is (equal '("") (gallop.core::path-ancestors "/")))
  (is (= 1/2 (gallop.core::parse-cgroup-v2-max "50000 100000")))
  (is (= 3 (gallop.core::parse-cgroup-v2-max "300000 100000")))
  (is (null (gallop.core::parse-cgroup-v2-max "max 100000")))
  (is (null (gallop.core::parse-cgroup-v2-max "")))
  (is (null (gallop.core::parse-cgroup-v2-max nil)))
  (is (= 1/4 (gallop.core::parse-cgroup-v1-quota "25000" "100000")))
  (is (null (gallop.core::parse-cgroup-v1-quota "-1" "100000")))
  (is (null (gallop.core::parse-cgroup-v1-quota nil nil)))
  ;; This process: a positive number, never more than its affinity allows.
  (let ((cpus (gallop.core::usable-cpus)))
    (is (and (plusp cpus) (<= cpus (gallop.core::allowed-cpu-count))))))

(test blocked-workers-are-told-from-running-and-free-ones
  "The pool's growth counts the workers that are blocked while serving an
event: serving (an odd count in their WORKER record) and not wanting a CPU
\(state R in /proc/self/task/TID/stat).  A spinning thread is runnable, a
thread waiting on a semaphore is not, a worker not serving is never blocked,
and the count stops at its limit.  More serving workers runnable than
+RUNNABLE-PER-CPU+ times the CPUs make it 0: the CPUs are taken, another
thread would wait too."
  (let* ((stop nil)
         (gate (sb-thread:make-semaphore))
         (buffer (make-array 128 :element-type '(unsigned-byte 8)))
         (spinners (loop repeat (1+ gallop.core::+runnable-per-cpu+)
                         collect (sb-thread:make-thread (lambda () (loop until stop))
                                                        :name "spinning (test)")))
         (spinner (first spinners))
         (waiters (loop repeat 3 collect (sb-thread:make-thread
                                          (lambda () (sb-thread:wait-on-semaphore gate))
                                          :name "waiting (test)"))))
    (flet ((runnable (thread)
             (gallop.core::thread-runnable-p
              (gallop.core::thread-stat-path (sb-thread:thread-os-tid thread)) buffer))
           (worker (thread serving)
             (let ((w (gallop.core::make-worker thread (sb-thread:thread-os-tid thread))))
               (setf (gallop.core::worker-serving w) serving)
               w))
           (pool (&rest workers)
             (let ((pool (gallop.core::make-pool)))
               (setf (gallop.core::pool-workers pool) workers)
               pool)))
      (unwind-protect
           (progn
             ;; Until each is where the test put it (a thread just started
             ;; may still be running on its way to the semaphore).
             (is-true (wait-until (lambda () (notany #'runnable waiters))))
             (is-true (wait-until (lambda () (every #'runnable spinners))))
             (sb-sys:without-gcing
               ;; A collection stops every thread, the spinners too (then not
               ;; runnable): none may start while the states are read.
               (is-true (wait-until (lambda () (every #'runnable spinners))))
               (flet ((blocked (pool limit &optional (cpus 8))
                        (gallop.core::blocked-workers pool nil limit cpus buffer)))
                 (let ((serving (mapcar (lambda (w) (worker w 7)) waiters)))
                   (is (= 3 (blocked (apply #'pool serving) 10)))
                   (is (= 2 (blocked (apply #'pool serving) 2)) "the count stops at its limit")
                   (is (= 0 (blocked (apply #'pool serving) 0))))
                 (is (= 0 (blocked (pool (worker spinner 1)) 10)) "a running worker is not blocked")
                 (is (= 0 (blocked (apply #'pool (mapcar (lambda (w) (worker w 8)) waiters)) 10))
                     "a waiting worker that is not serving is not blocked")
                 (is (= 1 (blocked (pool (worker spinner 3) (worker (first waiters) 5)
                                         (worker (second waiters) 6))
                                   10)))
                 ;; One serving worker runnable: within the limit for 1 CPU,
                 ;; over it for 0; as many as the limit for 1 CPU still
                 ;; within it, one more over it.
                 (let ((serving (mapcar (lambda (w) (worker w 7)) waiters))
                       (at-limit (mapcar (lambda (s) (worker s 1))
                                         (rest spinners))))
                   (is (= 3 (blocked (apply #'pool (worker spinner 1) serving) 10 1)))
                   (is (= gallop.core::+runnable-per-cpu+ (length at-limit)))
                   (is (= 3 (blocked (apply #'pool (append at-limit serving)) 10 1))
                       "as many runnable serving workers as the limit for 1 CPU: growth")
                   (is (= 0 (blocked (apply #'pool (worker spinner 1) (append at-limit serving))
                                     10 1))
                       "one runnable serving worker over the limit for 1 CPU: no growth")
                   (is (= 0 (blocked (apply #'pool (worker spinner 1) serving) 10 0))
                       "a runnable serving worker first, no CPU: no growth")
                   (is (= 0 (blocked (apply #'pool (append serving (list (worker spinner 1)))) 10 0))
                       "a runnable serving worker last, no CPU: no growth")
                   (is (equal '(3 nil)
                              (multiple-value-list
                               (gallop.core::blocked-workers
                                (apply #'pool (worker spinner 1) (append at-limit serving))
                                nil 10 1 buffer nil t)))
                       "over the limit for 1 CPU, but the CPUs were idle lately: a burst, growth"))))
             (is (null (gallop.core::thread-runnable-p
                             (gallop.core::thread-stat-path 999999999) buffer))
                 "a thread that does not exist"))
        (setf stop t)
        (sb-thread:signal-semaphore gate 3)
        (mapc #'sb-thread:join-thread (append spinners waiters))))))

;;; The CPUs' idle time (cpus.lisp, "Whether the CPUs have time to spare").

(test proc-stat-idle-is-read-for-the-cpus-the-process-may-use
  "PARSE-CPUS-IDLE sums, over the cpuN lines of /proc/stat whose CPU is in the
mask, the idle and iowait fields (the 4th and 5th) as idle, and the first
eight fields as all: not the \"cpu\" line of all CPUs, not the guest fields,
not a line cut short."
  (flet ((parse (text mask)
           (let ((octets (map 'gallop.core::octets #'char-code text)))
             (multiple-value-list (gallop.core::parse-cpus-idle octets (length octets) mask)))))
    (let ((stat (format nil "cpu  100 0 100 1000 0 0 0 0 0 0~@
                             cpu0 10 1 20 300 5 1 2 3 7 9~@
                             cpu1 40 0 30 500 10 0 0 0 0 0~@
                             cpu12 1 2 3 4 5 6 7 8 9 10~@
                             intr 123 4 5~%")))
      (is (equal '(815 922) (parse stat #b11)) "CPUs 0 and 1")
      (is (equal '(510 580) (parse stat #b10)) "CPU 1 alone")
      (is (equal '(9 36) (parse stat (ash 1 12))) "a CPU number of two digits")
      (is (equal '(0 0) (parse stat #b100)) "a CPU /proc/stat does not list")
      (is (equal '(305 342) (parse (subseq stat 0 (+ (search "cpu1" stat) 12)) #b11))
          "a last line cut short counts for nothing")
      (is (equal '(0 0) (parse "" #b1))))
    ;; This machine's: unknown until three readings, then a share.
    (let ((meter (gallop.core::make-idle-meter))
          (mask (gallop.core::allowed-cpu-mask)))
      (is (plusp mask))
      (is (= (logcount mask) (gallop.core::allowed-cpu-count)))
      (is (null (gallop.core::idle-meter-share meter mask)))
      (sleep 0.05)
      (is (null (gallop.core::idle-meter-share meter mask)))
      (sleep 0.05)
      (let ((share (gallop.core::idle-meter-share meter mask)))
        (is (and (realp share) (<= 0 share 1)) "a share: ~S" share))
      (is (null (gallop.core::idle-meter-share meter (logand mask (- mask))))
          "another mask starts over"))))

(test with-idle-cpus-a-blocked-worker-is-enough-to-grow
  "A group whose workers are all busy grows when more than half its permit
holders are blocked; when the CPUs were idle lately (CPUS-IDLE), for any one
blocked, however many of its workers are runnable: a CPU is free, and what
the blocked worker's connections wait for is a thread (on one CPU, with
handlers that sleep 1 ms, the pool left a third of the CPU idle)."
  (let* ((stop nil)
         (buffer (make-array 128 :element-type '(unsigned-byte 8)))
         (sleeper (sb-thread:make-thread (lambda () (sleep 60)) :name "sleeping (test)"))
         (spinners (loop repeat (1+ gallop.core::+runnable-per-cpu+)
                         collect (sb-thread:make-thread (lambda () (loop until stop))
                                                        :name "spinning (test)"))))
    (flet ((runnable (thread)
             (gallop.core::thread-runnable-p
              (gallop.core::thread-stat-path (sb-thread:thread-os-tid thread)) buffer)))
      (unwind-protect
           (progn
             (is-true (wait-until (lambda () (not (runnable sleeper)))))
             (is-true (wait-until (lambda () (every #'runnable spinners))))
             (let* ((pool (gallop.core::make-pool))
                    (group (gallop.core::make-group))
                    (holders (+ 1 (length spinners)))
                    (found (make-array 16 :initial-element nil))
                    (brief-waits (make-hash-table :test 'eq)))
               ;; Every worker serving: the spinners first (runnable, over
               ;; the limit for one CPU), then the sleeper, the only blocked.
               (setf (gallop.core::pool-groups pool) (vector group)
                     (gallop.core::pool-workers pool)
                     (loop for thread in (append spinners (list sleeper))
                           collect (let ((w (gallop.core::make-worker
                                             thread (sb-thread:thread-os-tid thread) group)))
                                     (setf (gallop.core::worker-serving w) 1)
                                     w))
                     (gallop.core::group-holders group) holders
                     (gallop.core::group-allowed group) holders
                     ;; More threads than permits: growth adds a permit, no thread.
                     (gallop.core::group-thread-count group) (* 2 holders))
               (flet ((samples (cpus-idle)
                        ;; Two samples (growth needs two in a row), the
                        ;; process at half its CPUs, its share 1 CPU.
                        (loop repeat 2
                              do (sb-sys:without-gcing
                                   (gallop.core::resize-group pool group 0.5 1 buffer found
                                                              brief-waits cpus-idle)))
                        (gallop.core::group-allowed group)))
                 (is (= holders (samples nil)) "CPUs not idle: runnable workers hold it back")
                 (is (= (1+ holders) (samples t)) "CPUs idle: one blocked worker, one permit more")
                 (setf (gallop.core::pool-workers pool)
                       (remove sleeper (gallop.core::pool-workers pool)
                               :key #'gallop.core::worker-thread))
                 (is (= (1+ holders) (samples t)) "none blocked: no growth, CPUs idle or not"))))
        (setf stop t)
        (sb-thread:terminate-thread sleeper)
        (mapc #'sb-thread:join-thread spinners)
        (sb-thread:join-thread sleeper :default nil)))))

(test the-makers-load-is-over-its-last-samples
  "The share of its CPUs the process used, which the maker compares with its
limits, is over its last +LOAD-SAMPLES+ samples (NOTE-LOAD), not the last
one: handlers that sleep make one 5 ms sample jump."
  (let ((ms (/ internal-time-units-per-second 1000))
        (history (gallop.core::make-load-history 0 0)))
    (is (= 4 gallop.core::+load-samples+))
    (flet ((note (cpu-us at-ms cpus)
             (gallop.core::note-load history cpu-us (* at-ms ms) cpus)))
      (is (= 1 (note 5000 5 1)) "one CPU used 5 ms of 5")
      (is (= 1/2 (note 5000 10 1)) "then none: 5 ms of 10")
      (is (= 1/3 (note 5000 15 1)))
      (is (= 1/4 (note 5000 20 1)))
      (is (= 0 (note 5000 25 1)) "the first sample's 5 ms fell out of the window")
      (is (= 1/4 (note 15000 30 2)) "10 ms of two CPUs' 20 ms")
      (is (= (* 30 ms) (gallop.core::load-history-last-wall history))))))

(test blocked-workers-waiting-briefly-count-after-a-while
  "A worker blocked inside futex(2) (a lock, a semaphore) counts toward growth
only when looks found it there on the same event for +BRIEF-WAIT-MS+: a
wait for a preempted lock holder ends before, a handler waiting on a
semaphore for its database does not.  A worker blocked in another system
call (sleeping) counts at once; one running again does not count.
/proc/self/task/TID/syscall tells them apart (THREAD-WAIT-KIND)."
  (let* ((gate (sb-thread:make-semaphore))
         (buffer (make-array 128 :element-type '(unsigned-byte 8)))
         (stop nil)
         (waiter (sb-thread:make-thread (lambda () (sb-thread:wait-on-semaphore gate))
                                        :name "waiting (test)"))
         (sleeper (sb-thread:make-thread (lambda () (sleep 60)) :name "sleeping (test)"))
         (spinner (sb-thread:make-thread (lambda () (loop until stop)) :name "spinning (test)")))
    (flet ((kind (thread)
             (gallop.core::thread-wait-kind
              (gallop.core::thread-syscall-path (sb-thread:thread-os-tid thread)) buffer))
           (runnable (thread)
             (gallop.core::thread-runnable-p
              (gallop.core::thread-stat-path (sb-thread:thread-os-tid thread)) buffer))
           (worker (thread serving)
             (let ((w (gallop.core::make-worker thread (sb-thread:thread-os-tid thread))))
               (setf (gallop.core::worker-serving w) serving)
               w)))
      (unwind-protect
           (progn
             (is-true (wait-until (lambda () (notany #'runnable (list waiter sleeper)))))
             (is-true (wait-until (lambda () (runnable spinner))))
             ;; Waited for, not read once: a garbage collection elsewhere in
             ;; the tests stops every thread in futex(2) for a while.
             (is-true (wait-until (lambda () (eq :brief (kind waiter))))
                      "a thread waiting on a semaphore is in futex(2)")
             (is-true (wait-until (lambda () (eq :call (kind sleeper))))
                      "a sleeping thread is in another call")
             (is-true (wait-until (lambda () (eq :running (kind spinner))))
                      "a running one is in none")
             (let* ((waiting (worker waiter 7))
                    (sleeping (worker sleeper 9))
                    (pool (gallop.core::make-pool))
                    (found (make-array 8 :initial-element nil))
                    (brief-waits (make-hash-table :test 'eq)))
               (setf (gallop.core::pool-workers pool) (list waiting sleeping))
               (flet ((look (now)
                        ;; (No collection between the reads: see above.)
                        (sb-sys:without-gcing
                          (let ((blocked (gallop.core::blocked-workers pool nil 10 8 buffer found)))
                            (list blocked (gallop.core::confirmed-blocked found blocked buffer
                                                                          brief-waits now))))))
                 (let ((wait gallop.core::+brief-wait-ms+))
                   (is (equal '(2 1) (look 1000)) "first look: the sleeper only")
                   (is (equal '(2 1) (look (+ 1000 (1- wait)))) "same event, not long enough")
                   (is (equal '(2 2) (look (+ 1000 wait))) "long enough: both")
                   (is (equal '(2 2) (look (+ 1005 wait))))
                   (setf (gallop.core::worker-serving waiting) 11)
                   (is (equal '(2 1) (look 2000)) "a futex wait on another event starts again")
                   (is (equal '(2 2) (look (+ 2000 wait)))))
                 (is (equal '(1 1) (let ((short (make-array 2 :initial-element nil)))
                                     (sb-sys:without-gcing
                                       (let ((blocked (gallop.core::blocked-workers
                                                       pool nil 1 8 buffer short)))
                                         (list blocked (gallop.core::confirmed-blocked
                                                        short blocked buffer brief-waits
                                                        3000))))))
                     "FOUND holds as many as it can, and the count stops at its limit")
                 ;; A worker that runs again between its state's read and
                 ;; its call's: not counted.
                 (let ((running (make-array 2 :initial-contents (list (worker spinner 3) 3))))
                   (is (= 0 (sb-sys:without-gcing
                              (gallop.core::confirmed-blocked running 1 buffer brief-waits
                                                              3000))))))))
        (setf stop t)
        (sb-thread:signal-semaphore gate)
        (sb-thread:terminate-thread sleeper)
        (mapc #'sb-thread:join-thread (list waiter spinner))
        (sb-thread:join-thread sleeper :default nil)))))

(test a-wait-for-the-world-lock-is-not-a-blocked-handler
  "A worker waiting in futex(2) while another thread holds SBCL's world lock
(compiling, or filling a generic function's caches on a server's first
requests) is not counted blocked, however long it waits: a thread added
would wait for the same lock.  The control, a worker waiting as long on a
mutex of its own, is counted."
  (let* ((buffer (make-array 128 :element-type '(unsigned-byte 8)))
         (mutex (sb-thread:make-mutex :name "held by the test"))
         (wait gallop.core::+brief-wait-ms+)
         (threads '()))
    (flet ((kind (thread)
             (gallop.core::thread-wait-kind
              (gallop.core::thread-syscall-path (sb-thread:thread-os-tid thread)) buffer))
           (confirmed (thread)
             ;; Two looks +BRIEF-WAIT-MS+ apart on the same event.
             (let ((worker (gallop.core::make-worker thread (sb-thread:thread-os-tid thread)))
                   (brief-waits (make-hash-table :test 'eq)))
               (setf (gallop.core::worker-serving worker) 5)
               (loop for now in (list 1000 (+ 1000 wait))
                     collect (sb-sys:without-gcing
                               (gallop.core::confirmed-blocked (vector worker 5) 1 buffer
                                                               brief-waits now))))))
      (unwind-protect
           (progn
             (sb-thread:with-mutex (mutex)
               (let ((waiter (sb-thread:make-thread (lambda () (sb-thread:with-mutex (mutex)))
                                                    :name "waiting on a mutex (test)")))
                 (push waiter threads)
                 (is-true (wait-until (lambda () (eq :brief (kind waiter)))))
                 (is (equal '(0 1) (confirmed waiter)) "the control counts once it waited long")))
             (sb-kernel:with-world-lock ()
               (let ((waiter (sb-thread:make-thread (lambda () (sb-kernel:with-world-lock ()))
                                                    :name "waiting on the world lock (test)")))
                 (push waiter threads)
                 (is-true (wait-until (lambda () (eq :brief (kind waiter)))))
                 (is (equal '(0 0) (confirmed waiter))
                     "a wait while another thread holds the world lock never counts"))))
        (mapc #'sb-thread:join-thread threads)))))
