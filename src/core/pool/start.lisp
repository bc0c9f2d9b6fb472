;;;; start.lisp -- starting a pool (its groups' epoll sets, the maker, the
;;;; standby workers) and stopping it.
;;;;
;;;; POOL-START makes every group's epoll set and nudge eventfd and the
;;;; pool's wake eventfd, then starts the maker and each group's share of
;;;; STANDBY-THREADS (at least one: a group without a thread would leave its
;;;; connections to stealing).  POOL-STOP sets STOPPING and signals the wake
;;;; eventfd, which is level-triggered and in every set: once it is
;;;; readable, every worker exits once its current event is served, and
;;;; every thread the pool started (in THREADS, OUTSIDE or RETIRED) is
;;;; joined before the sets close.

(in-package #:gallop.core)

(defun pool-start (pool)
  "Create the groups' epoll sets, the maker thread and STANDBY-THREADS workers
\(at least one per group)."
  (let* ((cpus (usable-cpus))
         ;; No more groups than threads: each needs one.
         (count (min (or *group-count* (max 1 (ceiling cpus))) (pool-max-threads pool)))
         (share (group-cpu-share cpus count (pool-max-threads pool)))
         (groups (make-array count)))
    (setf (pool-wake-fd pool) (make-eventfd)
          (pool-stopping pool) nil
          (pool-maker-helps pool) *maker-helps*)
    (dotimes (i count)
      (let ((group (make-group)))
        (setf (group-index group) i
              (group-epfd group) (epoll-create)
              (group-nudge-fd group) (make-eventfd)
              (group-allowed group) share
              (group-permits group) (sb-thread:make-semaphore :name "gallop run permits"
                                                              :count share)
              ;; STANDBY-THREADS shared out, but at least one each: a group
              ;; without a thread would leave its connections to stealing.
              (group-standby-threads group)
              (max 1 (+ (floor (pool-standby-threads pool) count)
                        (if (< i (mod (pool-standby-threads pool) count)) 1 0))))
        ;; Level-triggered: once signalled (at stop), every waiter sees it.
        (epoll-ctl (group-epfd group) +epoll-ctl-add+ (pool-wake-fd pool) +epollin+ +wake-data+)
        ;; Edge-triggered: each nudge wakes one waiter.
        (epoll-ctl (group-epfd group) +epoll-ctl-add+ (group-nudge-fd group)
                   (logior +epollin+ +epollet+) +nudge-data+)
        (setf (svref groups i) group)))
    (setf (pool-groups pool) groups)
    (setf (pool-maker pool)
          (start-pool-thread pool (lambda () (maker-loop pool))
                             (format nil "~A-thread-maker" (pool-name pool)) "maker"))
    (loop for group across groups
          do (dotimes (i (group-standby-threads group))
               (spawn-worker pool group))))
  pool)


(defun pool-stop (pool)
  "Stop the pool: every worker exits once its current event is served, and
every thread the pool started is joined.  Closes the epoll sets.  Events
still queued belong to connections that are still parked, which the engine
then closes."
  (setf (pool-stopping pool) t)
  (when (>= (pool-wake-fd pool) 0)
    (signal-eventfd (pool-wake-fd pool)))
  (sb-thread:signal-semaphore (pool-maker-semaphore pool))
  ;; Threads waiting for a permit: let each see STOPPING.
  (loop for group across (pool-groups pool)
        do (sb-thread:signal-semaphore (group-permits group) (1+ (pool-thread-count pool))))
  (when (pool-maker pool)
    (sb-thread:join-thread (pool-maker pool) :default nil)
    (setf (pool-maker pool) nil))
  (loop for threads = (sb-thread:with-mutex ((pool-lock pool))
                        (append (pool-threads pool) (pool-outside pool)
                                (shiftf (pool-retired pool) '())))
        while threads
        do (dolist (thread threads)
             (sb-thread:join-thread thread :default nil))
           (join-retired pool))
  (loop for group across (pool-groups pool)
        do (when (>= (group-epfd group) 0)
             (close-fd (group-epfd group))
             (setf (group-epfd group) -1))
           (when (>= (group-nudge-fd group) 0)
             (close-fd (group-nudge-fd group))
             (setf (group-nudge-fd group) -1)))
  (when (>= (pool-wake-fd pool) 0)
    (close-fd (pool-wake-fd pool))
    (setf (pool-wake-fd pool) -1))
  pool)
