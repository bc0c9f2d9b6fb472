;;;; pool.lisp -- an elastic pool of worker threads sharing one epoll set.
;;;;
;;;; Workers are leaders/followers: each idle worker waits in epoll_wait on the
;;;; pool's epoll set, and the worker that receives an event serves it in place,
;;;; so a ready connection costs one thread wake-up and no hand-off queue.
;;;; Connections are registered EPOLLONESHOT, so an event goes to exactly one
;;;; worker and the connection stays disarmed until it is re-armed.
;;;;
;;;; Elasticity: when a worker takes an event and no other worker is left
;;;; waiting, it asks the maker thread for one more worker (up to MAX-THREADS).
;;;; The maker grants it only while the process leaves CPU idle (under
;;;; +GROWTH-CPU-LIMIT+ of the CPUs it may run on, sampled every 5 ms, one new
;;;; worker per sample): then the busy workers are blocked (sleeping, waiting
;;;; on a database) and another worker adds throughput.  When the CPUs are saturated, another thread would
;;;; only add contention and tail latency, so the pool does not grow.  Thread
;;;; creation is serialised through the maker because SBCL creates threads
;;;; under one global mutex.  A worker that waits IDLE-TIMEOUT-MS without an
;;;; event leaves while more than MIN-THREADS remain.
;;;;
;;;; Invariants:
;;;;  - THREAD-COUNT = (length THREADS) <= MAX-THREADS, both under LOCK.
;;;;  - IDLE counts the workers inside epoll_wait; it only changes atomically.
;;;;  - A worker that leaves removes itself from THREADS and pushes itself onto
;;;;    RETIRED under LOCK; the maker (or POOL-STOP) joins the retired ones, so
;;;;    every thread the pool started is joined.
;;;;  - Once STOPPING is true the wake eventfd is readable forever, so every
;;;;    worker leaves epoll_wait and exits once its current event is served.

(in-package #:gallop.core)

(defconstant +wake-data+ (1- (expt 2 64))
  "epoll data of the pool's wake eventfd.")

(defstruct (pool (:constructor %make-pool) (:copier nil))
  (name "gallop" :type string)
  (epfd -1 :type fixnum)
  (wake-fd -1 :type fixnum)
  (min-threads 4 :type (integer 1))
  (max-threads 100 :type (integer 1))
  (idle-timeout-ms 10000 :type fixnum)
  (idle 0 :type sb-ext:word)
  (lock (sb-thread:make-mutex :name "gallop pool"))
  (threads '() :type list)
  (thread-count 0 :type fixnum)
  (retired '() :type list)
  (maker nil)
  (maker-semaphore (sb-thread:make-semaphore :name "gallop thread maker"))
  (stopping nil)
  (dispatch nil :type (or null function))
  (thread-starter nil :type (or null function))
  (log-error nil :type (or null function)))

(defun make-pool (&key (name "gallop") (min-threads 4) (max-threads 100)
                    (idle-timeout 10) dispatch thread-starter log-error)
  "Make a stopped pool.  DISPATCH is called in a worker as (DISPATCH DATA
FLAGS) for every epoll event on a connection registered in the pool's epoll
set.  THREAD-STARTER, when given, is called as (THREAD-STARTER THUNK NAME)
and must return a new thread running THUNK.  LOG-ERROR is called as
(LOG-ERROR CONDITION) for errors that escape DISPATCH.  IDLE-TIMEOUT is in
seconds."
  (assert (<= 1 min-threads max-threads) (min-threads max-threads)
          "Need 1 <= MIN-THREADS (~D) <= MAX-THREADS (~D)." min-threads max-threads)
  (%make-pool :name name :min-threads min-threads :max-threads max-threads
              :idle-timeout-ms (round (* 1000 idle-timeout))
              :dispatch dispatch :thread-starter thread-starter :log-error log-error))

(defun pool-idle-count (pool)
  "Workers currently waiting for an event."
  (pool-idle pool))

(defun start-pool-thread (pool function name)
  (let ((starter (pool-thread-starter pool)))
    (if starter
        (funcall starter function name)
        (sb-thread:make-thread function :name name))))

(defun pool-start (pool)
  "Create the epoll set, the maker thread and MIN-THREADS workers."
  (setf (pool-epfd pool) (epoll-create)
        (pool-wake-fd pool) (make-eventfd)
        (pool-stopping pool) nil)
  (epoll-ctl (pool-epfd pool) +epoll-ctl-add+ (pool-wake-fd pool) +epollin+ +wake-data+)
  (setf (pool-maker pool)
        (start-pool-thread pool (lambda () (maker-loop pool))
                           (format nil "~A-thread-maker" (pool-name pool))))
  (dotimes (i (pool-min-threads pool))
    (spawn-worker pool))
  pool)

(defun spawn-worker (pool)
  "Start one worker unless the pool is full or stopping.  Called from the
maker thread, or from POOL-START."
  (let ((proceed nil))
    (sb-thread:with-mutex ((pool-lock pool))
      (when (and (not (pool-stopping pool))
                 (< (pool-thread-count pool) (pool-max-threads pool)))
        (incf (pool-thread-count pool))
        (setf proceed t)))
    (when proceed
      (handler-case
          (let ((thread (start-pool-thread pool (lambda () (worker-loop pool))
                                           (format nil "~A-worker" (pool-name pool)))))
            (sb-thread:with-mutex ((pool-lock pool))
              (push thread (pool-threads pool))))
        (error (e)
          (sb-thread:with-mutex ((pool-lock pool))
            (decf (pool-thread-count pool)))
          (when (pool-log-error pool) (funcall (pool-log-error pool) e)))))))

(defun request-worker (pool)
  "Ask the maker thread for one more worker."
  (sb-thread:signal-semaphore (pool-maker-semaphore pool)))

(defun join-retired (pool)
  (let ((retired (sb-thread:with-mutex ((pool-lock pool))
                   (shiftf (pool-retired pool) '()))))
    (dolist (thread retired)
      (sb-thread:join-thread thread :default nil))))

(defconstant +growth-cpu-limit+ 0.85
  "The pool grows only while the process uses less than this share of its CPUs.")

(defun maker-loop (pool)
  (let* ((cpus (allowed-cpu-count))
         (last-cpu (process-cpu-us))
         (last-wall (get-internal-real-time))
         (us-per-unit (/ 1000000 internal-time-units-per-second))
         (load 1.0)
         (fresh nil))
    (loop
      (sb-thread:wait-on-semaphore (pool-maker-semaphore pool) :timeout 0.005)
      (join-retired pool)
      (when (pool-stopping pool)
        (return))
      ;; One load sample per 5 ms, and at most one new worker per sample, so
      ;; the effect of the last one is measured before the next.
      (let ((wall (get-internal-real-time)))
        (when (>= (* us-per-unit (- wall last-wall)) 5000)
          (let ((cpu (process-cpu-us)))
            (setf load (/ (- cpu last-cpu) (* cpus us-per-unit (- wall last-wall)))
                  last-cpu cpu
                  last-wall wall
                  fresh t))))
      ;; Requests that piled up while we were creating collapse into one check.
      (let ((piled (sb-thread:semaphore-count (pool-maker-semaphore pool))))
        (when (plusp piled)
          (sb-thread:try-semaphore (pool-maker-semaphore pool) piled)))
      (when (and fresh
                 (zerop (pool-idle pool))
                 (< (pool-thread-count pool) (pool-max-threads pool))
                 (< load +growth-cpu-limit+))
        (setf fresh nil)
        (spawn-worker pool)))))

(defun leave-pool (pool already-counted-out)
  (let ((self sb-thread:*current-thread*))
    (sb-thread:with-mutex ((pool-lock pool))
      (when (member self (pool-threads pool))
        (setf (pool-threads pool) (delete self (pool-threads pool)))
        (unless already-counted-out
          (decf (pool-thread-count pool)))
        (push self (pool-retired pool))))))

(defun try-retire (pool)
  "Leave the pool if it has more than MIN-THREADS workers.  True if leaving."
  (sb-thread:with-mutex ((pool-lock pool))
    (when (> (pool-thread-count pool) (pool-min-threads pool))
      (decf (pool-thread-count pool))
      t)))

(defun worker-loop (pool)
  (let ((events (make-event-buffer 1))
        (epfd (pool-epfd pool))
        (dispatch (pool-dispatch pool))
        (timeout (pool-idle-timeout-ms pool))
        (counted-out nil))
    (declare (type function dispatch) (type fixnum epfd timeout))
    (unwind-protect
         (loop
           (let ((started (now-ms)))
             (sb-ext:atomic-incf (pool-idle pool))
             (let ((n (epoll-wait epfd events 1 timeout)))
               (sb-ext:atomic-decf (pool-idle pool))
               (cond ((pool-stopping pool)
                      (return))
                     ((zerop n)
                      (when (and (>= (- (now-ms) started) timeout)
                                 (try-retire pool))
                        (setf counted-out t)
                        (return)))
                     (t
                      (let ((data (event-data events 0)))
                        (when (= data +wake-data+)
                          (return))
                        (when (and (zerop (pool-idle pool))
                                   (< (pool-thread-count pool) (pool-max-threads pool)))
                          (request-worker pool))
                        (handler-case (funcall dispatch data (event-flags events 0))
                          (error (e)
                            (let ((log (pool-log-error pool)))
                              (when log (ignore-errors (funcall log e))))))))))))
      (free-event-buffer events)
      (leave-pool pool counted-out))))

(defun pool-thread-count* (pool)
  (sb-thread:with-mutex ((pool-lock pool)) (pool-thread-count pool)))

(defun pool-stop (pool)
  "Stop the pool: every worker exits once its current event is served, and
every thread the pool started is joined.  Closes the epoll set."
  (setf (pool-stopping pool) t)
  (when (>= (pool-wake-fd pool) 0)
    (signal-eventfd (pool-wake-fd pool)))
  (sb-thread:signal-semaphore (pool-maker-semaphore pool))
  (when (pool-maker pool)
    (sb-thread:join-thread (pool-maker pool) :default nil)
    (setf (pool-maker pool) nil))
  (loop for threads = (sb-thread:with-mutex ((pool-lock pool))
                        (append (pool-threads pool) (shiftf (pool-retired pool) '())))
        while threads
        do (dolist (thread threads)
             (sb-thread:join-thread thread :default nil))
           (join-retired pool))
  (when (>= (pool-epfd pool) 0)
    (close-fd (pool-epfd pool))
    (setf (pool-epfd pool) -1))
  (when (>= (pool-wake-fd pool) 0)
    (close-fd (pool-wake-fd pool))
    (setf (pool-wake-fd pool) -1))
  pool)
