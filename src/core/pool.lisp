;;;; pool.lisp -- an elastic pool of worker threads sharing one epoll set.
;;;;
;;;; Workers are leaders/followers: each idle worker waits in epoll_wait on the
;;;; pool's epoll set, and the worker that receives an event serves it in place,
;;;; so a ready connection costs no thread hand-off.  Connections are
;;;; registered once, edge-triggered: an event goes to one worker, and one
;;;; that finds its connection busy marks it so that its owner reads again
;;;; (DISPATCH-EVENT in serve.lisp, PARK in lifecycle.lisp).
;;;;
;;;; One epoll_wait takes up to +BATCH+ events, so that under load a request
;;;; costs a fraction of that system call (nginx does the same).  The worker
;;;; serves the first and puts the others on the READY queue, which every
;;;; worker empties before it waits in epoll again: if the first handler
;;;; blocks, the others are not stuck behind it.  A connection that has
;;;; served its turn of pipelined requests queues itself there again
;;;; (POOL-REQUEUE), so the queue may never empty while clients pipeline: a
;;;; worker that takes such a connection from the queue first looks at
;;;; epoll, without waiting, and queues what it finds before serving it.
;;;; When it queued events while other workers sat in epoll_wait, it nudges
;;;; one of them through the NUDGE eventfd (registered edge-triggered, so
;;;; each nudge wakes one waiter).
;;;;
;;;; The READY queue also takes the thunks of application timers that came
;;;; due (POOL-SUBMIT, from the housekeeper, see timers.lisp): a worker runs
;;;; one as it serves an event, counted as serving.
;;;;
;;;; Elasticity has two levels, both decided by the maker thread, which
;;;; wakes every 5 ms (workers never wake it: that would cost a context switch
;;;; per request).  RUN PERMITS bound how many workers wait in or
;;;; serve from epoll at once (ALLOWED); the other threads wait for a permit.
;;;; ALLOWED starts at the number of CPUs this process may run on, because
;;;; for work that computes, more runnable workers than CPUs only add
;;;; preemption in mid-request (tail latency) and no throughput.  A permit
;;;; is added for a worker that blocks in a handler (sleeping, waiting on a
;;;; database), so that as many workers as there are CPUs can still run.
;;;; Blocking is seen directly, not inferred from the process's CPU use: each
;;;; worker counts the events it begins and ends serving (its WORKER record;
;;;; odd while serving, one store each, to a line no other thread writes), and
;;;; every 5 ms the maker reads, for each serving worker, its thread's state
;;;; from the kernel (cpus.lisp): R (running, or runnable and waiting for a
;;;; CPU) or not.  A worker serving the same event before and after its
;;;; state read, and not R, is blocked.  On a machine shared with other
;;;; processes the workers wait for CPUs others hold, in state R: that is
;;;; contention, not blocking, and more threads would only add to the wait.
;;;; When no permit holder is free (all busy), the process uses under
;;;; +GROWTH-CPU-LIMIT+ of its CPUs, and the permit holders that are not
;;;; blocked are fewer than the CPUs, or than half the holders (with many
;;;; workers blocked most of the time, those waking up at once may outnumber
;;;; the CPUs), and no more than twice as many serving workers as CPUs
;;;; were seen runnable (more means several wait for a CPU: on a machine
;;;; shared with other processes the process may use well under its CPUs
;;;; and still get no more, and each thread added to a 1 ms handler's pool
;;;; then only lengthened the queue for the CPUs: 9 to 12 seconds of
;;;; run-queue wait per second, from /proc/self/task/*/schedstat, on 79 to 93
;;;; threads; with this rule 68 to 73 threads served as many requests or more
;;;; at 10-20% less CPU each; stopping at CPUs runnable instead of twice
;;;; that lost requests), in two samples in a row, it adds a thread when
;;;; permits are free (threads that sat idle for IDLE-TIMEOUT-MS leave their
;;;; permits behind), else a permit and a thread for it (up to MAX-THREADS).
;;;; Samples during which a garbage collection ran are skipped: it stops
;;;; every thread but one.
;;;; When the CPUs are saturated, or holders sit idle for a second, it takes a
;;;; permit back (down to the CPU count); the holder that notices gives it up.
;;;; "CPUs" means the ones the process may use: its affinity mask, lowered by
;;;; its cgroup's CPU quota (cpus.lisp), re-read once a second.
;;;; Thread creation is serialised through the maker because SBCL creates
;;;; threads under one global mutex.  A thread that waits IDLE-TIMEOUT-MS
;;;; without work leaves while more than MIN-THREADS remain.
;;;;
;;;; Invariants:
;;;;  - THREAD-COUNT = (length THREADS) <= MAX-THREADS, both under LOCK.
;;;;    WORKERS holds the WORKER record of each thread in THREADS that has
;;;;    begun its loop, also under LOCK.
;;;;  - IDLE counts the workers inside epoll_wait; it only changes atomically.
;;;;  - HOLDERS counts the workers holding a run permit, free permits are the
;;;;    count of the PERMITS semaphore, and HOLDERS + free permits = ALLOWED
;;;;    once holders over the limit have given theirs up (compare-and-swap on
;;;;    HOLDERS, so exactly the surplus leaves).
;;;;  - A worker that leaves removes itself from THREADS and pushes itself onto
;;;;    RETIRED under LOCK; the maker (or POOL-STOP) joins the retired ones, so
;;;;    every thread the pool started is joined.
;;;;  - Once STOPPING is true the wake eventfd is readable forever, so every
;;;;    worker leaves epoll_wait and exits once its current event is served.
;;;;  - Every event taken from epoll is served once: by the worker that took
;;;;    it, or from the READY queue.  A connection may have a queued turn and
;;;;    a new epoll event at once; whichever comes second finds it busy
;;;;    (:ACTIVE, then marked :DIRTY) or finds nothing to read, and parks it
;;;;    again.  Events still queued at stop belong to connections that are
;;;;    still parked, which the engine then closes.

(in-package #:gallop.core)

(defconstant +wake-data+ (1- (expt 2 64))
  "epoll data of the pool's wake eventfd.")
(defconstant +nudge-data+ (- (expt 2 64) 4)
  "epoll data of the pool's nudge eventfd.")
(defconstant +batch+ 32
  "The most events one epoll_wait takes.")

(defstruct (worker (:constructor make-worker (thread tid)) (:copier nil))
  "What the maker thread reads of one worker.  Written by that worker only."
  (thread nil :read-only t)
  (tid 0 :type fixnum :read-only t)
  ;; Seven words either side of SERVING, so that no other object (a garbage
  ;; collection may move another worker's record next to this one) shares
  ;; its 64-octet cache line: its worker writes it twice per event.
  (pad-before-1 0) (pad-before-2 0) (pad-before-3 0) (pad-before-4 0)
  (pad-before-5 0) (pad-before-6 0) (pad-before-7 0)
  ;; Events begun plus events ended: odd while the worker serves one.
  (serving 0 :type sb-ext:word)
  (pad-after-1 0) (pad-after-2 0) (pad-after-3 0) (pad-after-4 0)
  (pad-after-5 0) (pad-after-6 0) (pad-after-7 0))

(defstruct (pool (:constructor %make-pool) (:copier nil))
  (name "gallop" :type string)
  (epfd -1 :type fixnum)
  (wake-fd -1 :type fixnum)
  (nudge-fd -1 :type fixnum)
  (ready (sb-concurrency:make-queue :name "gallop ready events"))
  (min-threads 4 :type (integer 1))
  (max-threads 100 :type (integer 1))
  (idle-timeout-ms 10000 :type fixnum)
  (idle 0 :type sb-ext:word)
  (allowed 1 :type fixnum)
  (holders 0 :type sb-ext:word)
  (permits (sb-thread:make-semaphore :name "gallop run permits"))
  (lock (sb-thread:make-mutex :name "gallop pool"))
  (threads '() :type list)
  (workers '() :type list)
  (thread-count 0 :type fixnum)
  (retired '() :type list)
  (maker nil)
  (maker-semaphore (sb-thread:make-semaphore :name "gallop thread maker"))
  (stopping nil)
  (dispatch nil :type (or null function))
  (timers nil) ; the engine's application timers (timers.lisp), while it runs
  (thread-starter nil :type (or null function))
  (log-error nil :type (or null function)))

(defvar *worker-pool* nil
  "In a pool's worker thread, that pool: GALLOP:AFTER without :SERVER
schedules on it.")

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
        (pool-nudge-fd pool) (make-eventfd)
        (pool-ready pool) (sb-concurrency:make-queue :name "gallop ready events")
        (pool-stopping pool) nil)
  (epoll-ctl (pool-epfd pool) +epoll-ctl-add+ (pool-wake-fd pool) +epollin+ +wake-data+)
  (epoll-ctl (pool-epfd pool) +epoll-ctl-add+ (pool-nudge-fd pool)
             (logior +epollin+ +epollet+) +nudge-data+)
  (let ((allowed (min (max 1 (ceiling (usable-cpus))) (pool-max-threads pool))))
    (setf (pool-allowed pool) allowed
          (pool-holders pool) 0
          (pool-permits pool) (sb-thread:make-semaphore :name "gallop run permits"
                                                        :count allowed)))
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

(defun join-retired (pool)
  (let ((retired (sb-thread:with-mutex ((pool-lock pool))
                   (shiftf (pool-retired pool) '()))))
    (dolist (thread retired)
      (sb-thread:join-thread thread :default nil))))

(defconstant +growth-cpu-limit+ 0.85
  "Permits are added only while the process uses less than this share of its CPUs.")

(defconstant +shrink-cpu-limit+ 0.95
  "Above this share of its CPUs, the process gives permits back.")

(defun add-permit (pool)
  (incf (pool-allowed pool))
  (sb-thread:signal-semaphore (pool-permits pool)))

(defun remove-permit (pool)
  "Take one permit back: a free one at once, else the next holder to notice
gives its up."
  (decf (pool-allowed pool))
  (sb-thread:try-semaphore (pool-permits pool)))

(defun maker-loop (pool)
  (let* ((cpus (usable-cpus))
         (floor (min (max 1 (ceiling cpus)) (pool-max-threads pool)))
         (cpus-read (get-internal-real-time))
         (last-cpu (process-cpu-us))
         (last-wall (get-internal-real-time))
         (us-per-unit (/ 1000000 internal-time-units-per-second))
         (last-gc sb-ext:*gc-run-time*)
         (stat-buffer (make-array 128 :element-type '(unsigned-byte 8)))
         (blocked-samples 0)
         (idle-samples 0))
    (loop
      ;; The CPUs may change (taskset, a new cgroup quota): look again once a second.
      (when (>= (- (get-internal-real-time) cpus-read) internal-time-units-per-second)
        (setf cpus (usable-cpus)
              floor (min (max 1 (ceiling cpus)) (pool-max-threads pool))
              cpus-read (get-internal-real-time)))
      (sb-thread:wait-on-semaphore (pool-maker-semaphore pool) :timeout 0.005)
      (join-retired pool)
      (when (pool-stopping pool)
        (return))
      ;; Requests that piled up collapse into this one look.
      (let ((piled (sb-thread:semaphore-count (pool-maker-semaphore pool))))
        (when (plusp piled)
          (sb-thread:try-semaphore (pool-maker-semaphore pool) piled)))
      ;; One CPU sample per 5 ms, and at most one change per sample, so the
      ;; effect of the last change is measured before the next.
      (let ((wall (get-internal-real-time)))
        (when (>= (* us-per-unit (- wall last-wall)) 5000)
          (let* ((cpu (process-cpu-us))
                 (load (/ (- cpu last-cpu) (* cpus us-per-unit (- wall last-wall)))))
            (setf last-cpu cpu
                  last-wall wall)
            (setf idle-samples (if (> (pool-idle pool) 1) (1+ idle-samples) 0))
            (unless (/= (shiftf last-gc sb-ext:*gc-run-time*) last-gc)
              ;; (A sample in which a garbage collection stopped every thread
              ;; but one says nothing about blocked handlers: skipped.)
              (setf blocked-samples
                    (if (and (zerop (pool-idle pool))
                             (< load +growth-cpu-limit+)
                             (or (< (pool-allowed pool) (pool-max-threads pool))
                                 (< (pool-thread-count pool) (pool-allowed pool)))
                             ;; The permit holders not blocked are fewer
                             ;; than the CPUs, or than half the holders.
                             ;; (Holders, not permits: threads that left
                             ;; idle may have left permits nobody holds.)
                             (let* ((holders (pool-holders pool))
                                    (enough (max floor (ceiling holders 2))))
                               (> (blocked-workers pool (- holders enough -1) floor stat-buffer)
                                  (- holders enough))))
                        (1+ blocked-samples)
                        0))
              ;; Growth starts after two such samples in a row (a thread's
              ;; state is a snapshot) and goes on one permit a sample while
              ;; they last; a thread is added when fewer threads than
              ;; permits remain (idle ones left since the permits were added).
              (cond ((>= blocked-samples 2)
                     ;; A free permit with no thread to take it: a thread.
                     ;; Else a permit, and a thread for it.
                     (when (and (>= (pool-thread-count pool) (pool-allowed pool))
                                (< (pool-allowed pool) (pool-max-threads pool)))
                       (add-permit pool))
                     (when (< (pool-thread-count pool) (pool-allowed pool))
                       (spawn-worker pool)))
                    ((and (> (pool-allowed pool) floor)
                          (or (> load +shrink-cpu-limit+) (> idle-samples 200)))
                     (setf idle-samples 0)
                     (remove-permit pool))))))))))

(defun blocked-workers (pool limit cpus buffer)
  "How many of POOL's workers are blocked while serving an event (see the
header), counting no further than LIMIT; 0 when more than twice CPUS of
the serving workers read are runnable (state R): the CPUs are taken, by
this process or by others, and another thread would only wait for one too.
BUFFER is for THREAD-RUNNABLE-P."
  (let ((count 0) (runnable 0))
    (declare (type fixnum count runnable))
    (when (plusp limit)
      (dolist (worker (sb-thread:with-mutex ((pool-lock pool))
                        (copy-list (pool-workers pool))))
        (let ((before (worker-serving worker)))
          (when (oddp before)
            (cond ((thread-runnable-p (worker-tid worker) buffer)
                   (when (> (incf runnable) (* 2 cpus))
                     (return-from blocked-workers 0)))
                  ((= before (worker-serving worker))
                   (when (>= (incf count) limit)
                     (return))))))))
    count))

(defun join-workers (pool worker)
  (sb-thread:with-mutex ((pool-lock pool))
    (push worker (pool-workers pool))))

(defun leave-pool (pool already-counted-out worker)
  (let ((self sb-thread:*current-thread*))
    (sb-thread:with-mutex ((pool-lock pool))
      (setf (pool-workers pool) (delete worker (pool-workers pool)))
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

(defun acquire-permit (pool)
  "Wait for a run permit.  True with one; NIL when stopping, or when no permit
came for IDLE-TIMEOUT-MS and this thread may leave the pool (then it was
counted out of THREAD-COUNT)."
  (loop
    (when (pool-stopping pool)
      (return nil))
    (cond ((sb-thread:wait-on-semaphore (pool-permits pool)
                                        :timeout (/ (pool-idle-timeout-ms pool) 1000))
           (when (pool-stopping pool)
             (sb-thread:signal-semaphore (pool-permits pool))
             (return nil))
           (sb-ext:atomic-incf (pool-holders pool))
           (return t))
          ((try-retire pool)
           (return :retired)))))

(defun surplus-holder-p (pool)
  "True, having given up this worker's permit, when more workers hold permits
than ALLOWED."
  (loop
    (let ((holders (pool-holders pool)))
      (when (<= holders (pool-allowed pool))
        (return nil))
      (when (eql holders (sb-ext:compare-and-swap (pool-holders pool) holders (1- holders)))
        (return t)))))

(defun release-permit (pool)
  (sb-ext:atomic-decf (pool-holders pool))
  (sb-thread:signal-semaphore (pool-permits pool)))

(defun worker-loop (pool)
  (let ((*worker-pool* pool)
        (events (make-event-buffer +batch+))
        (epfd (pool-epfd pool))
        (ready (pool-ready pool))
        (dispatch (pool-dispatch pool))
        (timeout (pool-idle-timeout-ms pool))
        (counted-out nil)
        (holding nil)
        (worker (make-worker sb-thread:*current-thread*
                             (sb-thread:thread-os-tid sb-thread:*current-thread*))))
    (declare (type function dispatch) (type fixnum epfd timeout))
    (join-workers pool worker)
    (flet ((serve (data flags)
             ;; DATA is an event's, or a timer's thunk (POOL-SUBMIT): both
             ;; counted as serving, so that one that blocks is seen blocked.
             (incf (worker-serving worker))
             (handler-case (if (functionp data)
                               (funcall data)
                               (funcall dispatch data flags))
               (serious-condition (e)
                 (let ((log (pool-log-error pool)))
                   (when log (ignore-errors (funcall log e))))))
             (incf (worker-serving worker)))
           (take-events (n keep-first)
             ;; Queue the N events epoll_wait left in EVENTS, but the first
             ;; connection's when KEEP-FIRST: that one is returned (with its
             ;; flags), for this worker to serve at once.  :WAKE when the
             ;; pool is stopping.
             (declare (type fixnum n))
             (let ((first nil) (first-flags 0) (queued 0))
               (declare (type fixnum queued))
               (dotimes (i n)
                 (let ((data (event-data events i)))
                   (cond ((= data +wake-data+) (return-from take-events :wake))
                         ((= data +nudge-data+)
                          (unless keep-first
                            ;; A look without waiting took a nudge meant
                            ;; for a worker in epoll_wait: pass it on.
                            (when (plusp (pool-idle pool))
                              (signal-eventfd (pool-nudge-fd pool)))))
                         ((and keep-first (null first))
                          (setf first data
                                first-flags (event-flags events i)))
                         (t (sb-concurrency:enqueue
                             ;; Queued as a fixnum: the event's data, negated
                             ;; (minus one) when its flags said more than
                             ;; "readable".
                             (if (= (event-flags events i) +epollin+) data (- -1 data))
                             ready)
                            (incf queued)))))
               (when (and (plusp queued) (plusp (pool-idle pool)))
                 (signal-eventfd (pool-nudge-fd pool)))
               (values first first-flags))))
      (unwind-protect
           (with-thread-buffers
            (loop
             (unless holding
               (let ((permit (acquire-permit pool)))
                 (case permit
                   ((nil) (return))
                   (:retired (setf counted-out t) (return))
                   (t (setf holding t)))))
             (multiple-value-bind (queued found) (sb-concurrency:dequeue ready)
               (when (and found (plusp (pool-idle pool))
                          (not (sb-concurrency:queue-empty-p ready)))
                 ;; More queued than this worker will serve now: pass the
                 ;; nudge on, so one nudge per batch wakes as many as needed.
                 (signal-eventfd (pool-nudge-fd pool)))
               (unless found
                 ;; Count this worker idle, then look once more: an event
                 ;; queued in between saw it idle and nudged, or is found
                 ;; here.  It stays counted until it leaves epoll_wait, so
                 ;; that whatever is queued from now on nudges.
                 (sb-ext:atomic-incf (pool-idle pool))
                 (multiple-value-setq (queued found) (sb-concurrency:dequeue ready))
                 (when found
                   (sb-ext:atomic-decf (pool-idle pool))))
               (cond ((functionp queued)
                      ;; A timer's thunk (POOL-SUBMIT).
                      (serve queued 0))
                     ((consp queued)
                      ;; A connection that served its turn (POOL-REQUEUE).
                      ;; The queue may never empty while clients pipeline:
                      ;; look at epoll first, without waiting, so that new
                      ;; events queue up now, before its next turn.
                      (when (eq :wake (take-events (epoll-wait epfd events +batch+ 0) nil))
                        (return))
                      (serve (car queued) +epollin+))
                     (found
                      (if (minusp queued)
                          (serve (- -1 queued) (logior +epollin+ +epollrdhup+))
                          (serve queued +epollin+)))
                     (t
                      ;; Counted idle above.
                      (let ((started (now-ms)))
                        (let ((n (epoll-wait epfd events +batch+ timeout)))
                          (sb-ext:atomic-decf (pool-idle pool))
                          (when (pool-stopping pool)
                            (return))
                          (when (and (zerop n)
                                     (>= (- (now-ms) started) timeout)
                                     (try-retire pool))
                            (setf counted-out t)
                            (return))
                          (multiple-value-bind (first first-flags) (take-events n t)
                            (case first
                              ((nil))
                              (:wake (return))
                              (t (serve first first-flags)))))))))
             (when (surplus-holder-p pool)
               (setf holding nil))))
        (when holding
          (release-permit pool))
        (free-event-buffer events)
        (leave-pool pool counted-out worker)))))

(defun pool-requeue (pool data)
  "Queue DATA for a worker as if epoll had just reported it readable, behind
the events already queued (a connection that has served its turn, see
SERVE-CONNECTION).  The caller has given the connection up."
  (sb-concurrency:enqueue (list data) (pool-ready pool)) ; a list: see WORKER-LOOP
  (when (plusp (pool-idle pool))
    (signal-eventfd (pool-nudge-fd pool))))

(defun pool-submit (pool thunk)
  "Queue THUNK for the next free worker (a timer that came due, see
timers.lisp), behind the events already queued."
  (sb-concurrency:enqueue thunk (pool-ready pool)) ; a function: see WORKER-LOOP
  (when (plusp (pool-idle pool))
    (signal-eventfd (pool-nudge-fd pool))))

(defun pool-stop (pool)
  "Stop the pool: every worker exits once its current event is served, and
every thread the pool started is joined.  Closes the epoll set."
  (setf (pool-stopping pool) t)
  (when (>= (pool-wake-fd pool) 0)
    (signal-eventfd (pool-wake-fd pool)))
  (sb-thread:signal-semaphore (pool-maker-semaphore pool))
  ;; Threads waiting for a permit: let each see STOPPING.
  (sb-thread:signal-semaphore (pool-permits pool) (1+ (pool-thread-count pool)))
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
  (when (>= (pool-nudge-fd pool) 0)
    (close-fd (pool-nudge-fd pool))
    (setf (pool-nudge-fd pool) -1))
  pool)
