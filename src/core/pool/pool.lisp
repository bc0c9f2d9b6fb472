;;;; pool.lisp -- an elastic pool of worker threads in groups, one epoll set
;;;; per group.
;;;;
;;;; GROUPS.  *GROUP-COUNT* groups (by default one per usable CPU, at most
;;;; MAX-THREADS), each with its own epoll set, READY queue, NUDGE eventfd,
;;;; run permits and workers.  A connection joins one group's set when it is
;;;; accepted (POOL-NEXT-GROUP, in turn) and stays there.  Groups share only
;;;; the wake eventfd (signalled at stop) and the maker thread: workers that
;;;; share a set contend on its kernel lock (doc/design.md, "An epoll set per
;;;; CPU").
;;;;
;;;; WORKERS of a group are leaders/followers: an idle one waits in
;;;; epoll_wait and serves what it gets in place.  Connections are registered
;;;; once, edge-triggered; any worker may serve any of them.  A lone waiter
;;;; takes up to +BATCH+ events and queues all but the first on READY; one
;;;; that waits beside others takes one (doc/design.md, "One event per
;;;; waiter").  Workers empty READY before they wait; whoever queues while
;;;; others wait nudges one.  READY also takes pipelined turns
;;;; (GROUP-REQUEUE) and due timers (POOL-SUBMIT).
;;;;
;;;; STEALING.  A worker about to wait takes work waiting in another group's
;;;; queue or set (STEAL-ONE), and the maker moves the work of a group busy
;;;; two samples in a row to an idle group (HELP-BUSY-GROUPS): no worker
;;;; sleeps while another set has work, and a group whose handlers all block
;;;; delays its connections by about 10 ms, not for as long as they block
;;;; (doc/design.md, "Stealing between groups").
;;;;
;;;; RUN PERMITS.  A group's ALLOWED bounds how many of its workers wait in
;;;; or serve from epoll at once; its other threads wait for a permit.
;;;; ALLOWED starts at the group's share of the usable CPUs (GROUP-CPU-SHARE).
;;;; Every +SAMPLE-MS+ the maker samples each group and acts on what the
;;;; sizing policy decides (RESIZE-GROUP; the policy, a pure function, and
;;;; its constants are in sizing.lisp): a permit for workers the kernel
;;;; shows blocked in a handler, never for ones waiting for a CPU; a permit
;;;; back, down to the share, when the CPUs are saturated, the holders sat
;;;; idle a second, or the extra permits cover no blocked worker.  Only the
;;;; maker starts threads (SBCL starts them under one global mutex); a
;;;; thread idle for THREAD-IDLE-TIMEOUT-MS leaves while its group has more
;;;; than its share of STANDBY-THREADS (at least one).
;;;;
;;;; RESTING.  After +STILL-SAMPLES-BEFORE-REST+ still samples the maker
;;;; sleeps up to a second at a time until a worker finds work.  Each side
;;;; writes its word, fences, then reads the other's, so no work begins
;;;; unseen (REST-MAKER-P, WAKE-RESTING-MAKER; doc/design.md, "A pool at
;;;; rest").
;;;;
;;;; Invariants:
;;;;  - THREAD-COUNT = (length THREADS) = the sum of the groups' THREAD-COUNTs
;;;;    <= MAX-THREADS, under LOCK; a worker that stepped out (POOL-STEP-OUT:
;;;;    held by one long-lived connection) is in OUTSIDE instead, uncounted.
;;;;    A leaving worker moves itself to RETIRED, which the maker or
;;;;    POOL-STOP joins: every thread started is joined.
;;;;  - A group's IDLE (in epoll_wait) and HOLDERS (holding a permit) change
;;;;    only atomically; HOLDERS + free PERMITS = ALLOWED once surplus holders
;;;;    gave theirs up (SURPLUS-HOLDER-P).
;;;;  - Every event taken from a set is served once.  A connection with both a
;;;;    queued turn and a new event is found busy (:DIRTY) or drained by the
;;;;    second, which parks it again.
;;;;  - A queuer reads IDLE after its enqueue, a worker counts itself idle
;;;;    before its last look at the queue (both atomic): no queued event
;;;;    waits for want of a nudge while a worker that could take it sleeps.
;;;;  - Once STOPPING, the wake eventfd (level-triggered, in every set) stays
;;;;    readable: every worker exits once its current event is served.

(in-package #:gallop.core)

(defconstant +wake-data+ (1- (expt 2 64))
  "epoll data of the pool's wake eventfd.")
(defconstant +nudge-data+ (- (expt 2 64) 4)
  "epoll data of a group's nudge eventfd.")
(defconstant +batch+ 32
  "The most events one epoll_wait takes, so that under load one system call
serves many requests (nginx does the same).  The worker serves the first and
queues the others on its group's READY queue, so that a first handler that
blocks holds none of them back.")
(defvar *group-count* nil
  "The number of groups (epoll sets) a pool starts with (at most its
MAX-THREADS), or NIL, the default, for one per usable CPU (as read when
the pool starts).  1 gives one epoll set for all the workers.
bench/server.lisp sets it from GALLOP_EPOLL_SETS, so that bench/epoll-sets.sh
can compare the two (doc/design.md, \"An epoll set per CPU\").")

(defvar *maker-helps* t
  "True: the maker moves the waiting events of a group whose workers are all
busy to an idle group (STEALING, HELP-BUSY-GROUPS).  Read by POOL-START.
Only the tests turn it off, to see the workers' own stealing alone.")

(defstruct (group (:constructor make-group ()) (:copier nil))
  "One epoll set, with its queue, nudge eventfd, run permits and workers (see
the header).  IDLE and HOLDERS change atomically, by its workers; the rest
after POOL-START is the maker's, or changes under the pool's LOCK."
  ;; Seven words either side, so that the counters its workers write on every
  ;; wait share no 64-octet cache line with another group's.
  (pad-before-1 0) (pad-before-2 0) (pad-before-3 0) (pad-before-4 0)
  (pad-before-5 0) (pad-before-6 0) (pad-before-7 0)
  (index 0 :type fixnum)                ; in the pool's GROUPS
  (epfd -1 :type fixnum)
  (nudge-fd -1 :type fixnum)
  (ready (sb-concurrency:make-queue :name "gallop ready events"))
  (idle 0 :type sb-ext:word)
  (holders 0 :type sb-ext:word)
  (allowed 1 :type fixnum)
  (permits (sb-thread:make-semaphore :name "gallop run permits"))
  (thread-count 0 :type fixnum)         ; under the pool's LOCK
  (standby-threads 1 :type fixnum)
  ;; The maker's: samples in a row with idle workers, and with none idle;
  ;; and the counters its sizing policy carries (sizing.lisp).
  (idle-samples 0 :type fixnum)
  (busy-samples 0 :type fixnum)
  (sizing (make-sizing-state) :type sizing-state)
  (pad-after-1 0) (pad-after-2 0) (pad-after-3 0) (pad-after-4 0)
  (pad-after-5 0) (pad-after-6 0) (pad-after-7 0))

(defmethod print-object ((group group) stream)
  (print-unreadable-object (group stream :type t :identity t)
    (format stream "~D" (group-index group))))

(defstruct (worker (:constructor make-worker (thread tid &optional group
                                             &aux (stat-path (thread-stat-path tid))
                                                  (syscall-path (thread-syscall-path tid))))
                   (:copier nil))
  "What the maker thread reads of one worker.  Written by that worker only."
  (thread nil :read-only t)
  (tid 0 :type fixnum :read-only t)
  (group nil :read-only t)
  (stat-path nil :type octets :read-only t) ; THREAD-STAT-PATH of TID
  (syscall-path nil :type octets :read-only t) ; THREAD-SYSCALL-PATH of TID
  ;; Seven words either side of SERVING, so that no other object (a garbage
  ;; collection may move another worker's record next to this one) shares
  ;; its 64-octet cache line: its worker writes it twice per event.
  (pad-before-1 0) (pad-before-2 0) (pad-before-3 0) (pad-before-4 0)
  (pad-before-5 0) (pad-before-6 0) (pad-before-7 0)
  ;; Events begun plus events ended: odd while the worker serves one.
  (serving 0 :type sb-ext:word)
  (pad-after-1 0) (pad-after-2 0) (pad-after-3 0) (pad-after-4 0)
  (pad-after-5 0) (pad-after-6 0) (pad-after-7 0))

(defmethod print-object ((worker worker) stream)
  (print-unreadable-object (worker stream :type t :identity t)
    (format stream "tid ~D" (worker-tid worker))))

(defstruct (pool (:constructor %make-pool) (:copier nil))
  (name "gallop" :type string)
  (groups #() :type simple-vector)
  (wake-fd -1 :type fixnum)
  (group-turn 0 :type sb-ext:word)     ; round robin, see POOL-NEXT-GROUP
  (moved 0 :type sb-ext:word)          ; events the maker moved to another group (STEALING)
  (stolen 0 :type sb-ext:word)         ; items a worker took from another group's queue or set
  (maker-helps t)                      ; *MAKER-HELPS* when the pool started
  (standby-threads 4 :type (integer 1))
  (max-threads 100 :type (integer 1))
  (thread-idle-timeout-ms 10000 :type fixnum)
  (lock (sb-thread:make-mutex :name "gallop pool"))
  (threads '() :type list)
  ;; The WORKER record of each thread in THREADS that has begun its loop
  ;; (under LOCK).
  (workers '() :type list)
  (thread-count 0 :type fixnum)
  ;; Workers that stepped out (POOL-STEP-OUT): held by one connection for
  ;; good, out of THREADS and THREAD-COUNT, joined once they exit.
  (outside '() :type list)
  (retired '() :type list)
  (maker nil)
  (maker-semaphore (sb-thread:make-semaphore :name "gallop thread maker"))
  ;; True while the maker rests (RESTING in the header).  Set only by the
  ;; maker (REST-MAKER-P); cleared by compare-and-swap, by the first worker
  ;; that leaves epoll_wait with work, which then wakes the maker
  ;; (WAKE-RESTING-MAKER), or by the maker when its second look finds a
  ;; worker out of epoll_wait.  While it is true the maker takes no sample.
  (maker-resting nil)
  (stopping nil)
  (dispatch nil :type (or null function))
  (timers nil) ; the engine's application timers (timers.lisp), while it runs
  (thread-starter nil :type (or null function))
  (log-error nil :type (or null function)))

(defmethod print-object ((pool pool) stream)
  (print-unreadable-object (pool stream :type t :identity t)
    (format stream "~A" (pool-name pool))))

(defvar *worker-pool* nil
  "In a pool's worker thread, that pool: GALLOP:AFTER without :SERVER
schedules on it.")

(defvar *worker-locals* nil
  "In a pool's worker thread, a simple vector of that thread's own, for the
layers above to keep per-thread state in without a lock (slot 0: the native
access log's buffers, access-log.lisp); NIL in any other thread.")

(defvar *step-out* nil
  "In a pool's worker thread, a function that makes it step out of the pool
\(POOL-STEP-OUT).")

(defun pool-step-out ()
  "Called in a worker whose current event will hold it for as long as a
client likes (a handler that reads a WebSocket in its own loop): the worker
leaves the pool's count and gives up its run permit now, so that the pool
serves on as if it were gone, and exits once that event is served.  A
replacement starts at once when none of its group's workers is idle.  NIL
outside a worker."
  (and *step-out* (funcall *step-out*)))

(defun make-pool (&key (name "gallop") (standby-threads 4) (max-threads 100)
                    (thread-idle-timeout 10) dispatch thread-starter log-error)
  "Make a stopped pool.  DISPATCH is called in a worker as (DISPATCH DATA
FLAGS) for every epoll event on a connection registered in one of the pool's
epoll sets.  THREAD-STARTER, when given, is called as (THREAD-STARTER THUNK
NAME) and must return a new thread running THUNK.  LOG-ERROR is called as
\(LOG-ERROR CONDITION) for errors that escape DISPATCH.  The pool's names
are the settings' (STANDBY-THREAD-COUNT, MAX-THREAD-COUNT,
THREAD-IDLE-TIMEOUT, in seconds)."
  (assert (<= 1 standby-threads max-threads) (standby-threads max-threads)
          "Need 1 <= STANDBY-THREADS (~D) <= MAX-THREADS (~D)." standby-threads max-threads)
  (%make-pool :name name :standby-threads standby-threads :max-threads max-threads
              :thread-idle-timeout-ms (round (* 1000 thread-idle-timeout))
              :dispatch dispatch :thread-starter thread-starter :log-error log-error))

(defun pool-idle-count (pool)
  "Workers currently waiting for an event, in all groups."
  (loop for group across (pool-groups pool) sum (group-idle group)))

(defun pool-run-permits (pool)
  "Run permits in all groups: how many workers may serve at once."
  (loop for group across (pool-groups pool) sum (group-allowed group)))

(defun pool-next-group (pool)
  "The group a new connection is registered in: each in turn (NIL before the
pool first started: such a connection is never registered)."
  (let* ((groups (pool-groups pool))
         (n (length groups)))
    (case n
      (0 nil)
      (1 (svref groups 0))
      (t (svref groups (mod (sb-ext:atomic-incf (pool-group-turn pool)) n))))))

(defun group-cpu-share (cpus groups max-threads)
  "The run permits a group keeps however idle it is: its share of CPUS (as
USABLE-CPUS reads them), at least 1, so that all groups together keep no
more than MAX-THREADS when they can."
  (max 1 (min (ceiling cpus groups) (floor max-threads groups))))

(defun start-pool-thread (pool function name role)
  "A thread of POOL running FUNCTION, named NAME for Lisp and \"gallop ROLE\"
for the kernel (SET-THREAD-OS-NAME), so that top -H and perf tell a
worker from the maker or the housekeeper."
  (let ((starter (pool-thread-starter pool))
        (body (let ((os-name (concatenate 'string "gallop " role)))
                (lambda ()
                  (set-thread-os-name os-name)
                  (funcall function)))))
    (if starter
        (funcall starter body name)
        (sb-thread:make-thread body :name name))))

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

(defun spawn-worker (pool group)
  "Start one worker in GROUP unless the pool is full or stopping.  Called from
the maker thread, or from POOL-START."
  (let ((proceed nil))
    (sb-thread:with-mutex ((pool-lock pool))
      (when (and (not (pool-stopping pool))
                 (< (pool-thread-count pool) (pool-max-threads pool)))
        (incf (pool-thread-count pool))
        (incf (group-thread-count group))
        (setf proceed t)))
    (when proceed
      (handler-case
          (let ((thread (start-pool-thread pool (lambda () (worker-loop pool group))
                                           (format nil "~A-worker" (pool-name pool)) "worker")))
            (sb-thread:with-mutex ((pool-lock pool))
              (push thread (pool-threads pool))))
        (error (e)
          (sb-thread:with-mutex ((pool-lock pool))
            (decf (pool-thread-count pool))
            (decf (group-thread-count group)))
          (when (pool-log-error pool) (funcall (pool-log-error pool) e)))))))

(defun join-retired (pool)
  ;; The maker calls this every 5 ms: no lock when there is nothing to join
  ;; (a thread that retires after this look is joined at the next).
  (let ((retired (and (pool-retired pool)
                      (sb-thread:with-mutex ((pool-lock pool))
                        (shiftf (pool-retired pool) '())))))
    (dolist (thread retired)
      (sb-thread:join-thread thread :default nil))))

(defstruct (load-history (:constructor make-load-history
                             (cpu-us wall
                              &aux (cpu-then (make-array +load-samples+ :initial-element cpu-us))
                                   (wall-then (make-array +load-samples+ :initial-element wall))))
                         (:copier nil))
  "The process's CPU time (microseconds, PROCESS-CPU-US) and the time
\(internal real time) at each of the maker's last +LOAD-SAMPLES+ samples; the
oldest at index COUNT mod +LOAD-SAMPLES+."
  (cpu-then nil :type simple-vector)
  (wall-then nil :type simple-vector)
  (count 0 :type fixnum))

(defmethod print-object ((history load-history) stream)
  (print-unreadable-object (history stream :type t :identity t)))

(defun note-load (history cpu-us wall cpus)
  "Record in HISTORY a sample taken at WALL (internal real time, later than
the last) when the process had used CPU-US; the share of CPUS the process
used since the oldest sample HISTORY kept."
  (let* ((k (mod (load-history-count history) +load-samples+))
         (cpu-then (load-history-cpu-then history))
         (wall-then (load-history-wall-then history))
         (load (/ (- cpu-us (svref cpu-then k))
                  (* cpus (/ 1000000 internal-time-units-per-second)
                     (max 1 (- wall (svref wall-then k)))))))
    (setf (svref cpu-then k) cpu-us
          (svref wall-then k) wall)
    (incf (load-history-count history))
    load))

(defun load-history-last-wall (history)
  "The time (internal real time) of the last sample HISTORY recorded."
  (svref (load-history-wall-then history)
         (mod (1- (load-history-count history)) +load-samples+)))

(defun add-permit (group)
  (incf (group-allowed group))
  (sb-thread:signal-semaphore (group-permits group)))

(defun remove-permit (group)
  "Take one permit of GROUP back: a free one at once, else the next holder to
notice gives its up."
  (decf (group-allowed group))
  (sb-thread:try-semaphore (group-permits group)))

(defconstant +peer-closed-flags+ (logior +epollrdhup+ +epollhup+ +epollerr+)
  "The epoll flags that say the client half-closed or the socket failed: what
DISPATCH-EVENT must learn of an event, since no later event repeats it.")

(declaim (inline encode-event queued-event-data queued-event-flags))
(defun encode-event (data flags)
  "An epoll event as it waits on a READY queue: a fixnum, the event's DATA,
negated (minus one) when its FLAGS hold one of +PEER-CLOSED-FLAGS+.  Other
flags are not kept: DISPATCH-EVENT reads a connection's state, not the
flags, to tell input from a drained socket (EPOLLOUT)."
  (if (logtest flags +peer-closed-flags+) (- -1 data) data))

(defun queued-event-data (item)
  "The epoll data of an event encoded by ENCODE-EVENT."
  (if (minusp item) (- -1 item) item))

(defun queued-event-flags (item)
  "The flags an event encoded by ENCODE-EVENT is served with."
  (if (minusp item) (logior +epollin+ +epollrdhup+) +epollin+))

(defun take-from-other-set (group events i)
  "Event I of EVENTS, which a thread that is not one of GROUP's workers (the
maker, or another group's worker: STEALING) took from GROUP's epoll set:
its ENCODE-EVENT encoding, or NIL for the wake eventfd (level-triggered, it
stays for GROUP's workers) and for GROUP's nudge (meant for GROUP's idle
workers: given back to them, if any is idle)."
  (let ((data (event-data events i)))
    (cond ((= data +wake-data+) nil)
          ((= data +nudge-data+)
           (when (plusp (group-idle group))
             (signal-eventfd (group-nudge-fd group)))
           nil)
          (t (encode-event data (event-flags events i))))))

(defconstant +still-samples-before-rest+ 20
  "Samples of the maker in a row (100 ms) in which every permit holder of
the pool waited in epoll_wait and none of its workers began or ended an
event, after which the maker may rest (RESTING in the header): it then
waits up to a second at a time, doing only its once-a-second chores (the
CPUs, the retired threads), until a worker wakes it, and starts its samples
afresh.  At a few requests a second the maker so rests between them, woken
once a request; at more it does not rest.")

(defun maker-loop (pool)
  (let* ((groups (pool-groups pool))
         (cpus (usable-cpus))
         (share (group-cpu-share cpus (length groups) (pool-max-threads pool)))
         ;; The CPUs' idle time, when no quota applies (cpus.lisp).
         (mask (allowed-cpu-mask))
         (idle-meter (make-idle-meter))
         (cpus-idle nil)
         (idle-interval (* +idle-read-ms+ (/ internal-time-units-per-second 1000)))
         (idle-read (get-internal-real-time))
         (cpus-read (get-internal-real-time))
         (history (make-load-history (process-cpu-us) (get-internal-real-time)))
         (us-per-unit (/ 1000000 internal-time-units-per-second))
         (last-gc sb-ext:*gc-run-time*)
         (stat-buffer (make-array 128 :element-type '(unsigned-byte 8)))
         ;; For CONFIRMED-BLOCKED: the workers BLOCKED-WORKERS found, and
         ;; those last seen waiting briefly (THREAD-WAIT-KIND).
         (found (make-array (* 2 (pool-max-threads pool)) :initial-element nil))
         (brief-waits (make-hash-table :test 'eq))
         (events (make-event-buffer +batch+))
         ;; RESTING (see the header), and the samples in a row in which no
         ;; event began or ended (EVENTS-SERVED).
         (resting nil)
         (still-samples 0)
         (last-served -1))
    (declare (type fixnum still-samples last-served))
    (unwind-protect
         (loop
           ;; The CPUs may change (taskset, a new cgroup quota): look again
           ;; once a second.  The number of groups stays.
           (when (>= (- (get-internal-real-time) cpus-read) internal-time-units-per-second)
             (setf cpus (usable-cpus)
                   share (group-cpu-share cpus (length groups) (pool-max-threads pool))
                   mask (allowed-cpu-mask)
                   cpus-read (get-internal-real-time)))
           (when (and (not resting)
                      (>= (- (get-internal-real-time) idle-read) idle-interval))
             (setf idle-read (get-internal-real-time)
                   cpus-idle (and (= cpus (logcount mask)) ; no quota
                                  (let ((idle (idle-meter-share idle-meter mask)))
                                    (and idle (>= idle +idle-cpus-share+))))))
           ;; A sample every 5 ms (a second while resting).  Workers do
           ;; not wake the maker per request: that would cost a context
           ;; switch each.
           (sb-thread:wait-on-semaphore (pool-maker-semaphore pool)
                                        :timeout (if resting 1 (/ +sample-ms+ 1000)))
           (join-retired pool)
           (when (pool-stopping pool)
             (return))
           ;; Requests that piled up collapse into this one look.
           (let ((piled (sb-thread:semaphore-count (pool-maker-semaphore pool))))
             (when (plusp piled)
               (sb-thread:try-semaphore (pool-maker-semaphore pool) piled)))
           (when (and resting (not (pool-maker-resting pool)))
             ;; A worker woke the maker: the load's samples start afresh,
             ;; over the time from now on, not over the rest.  The CPUs'
             ;; idle time is read at once, and that reading covers the
             ;; rest, when they were idle: a load that wakes the maker is
             ;; one that starts on idle CPUs.
             (let ((now (get-internal-real-time)))
               (setf resting nil
                     still-samples 0
                     history (make-load-history (process-cpu-us) now)
                     idle-read (- now idle-interval)
                     last-gc sb-ext:*gc-run-time*)))
           ;; One CPU sample per 5 ms, and at most one change per group and
           ;; sample, so the effect of the last change is measured before the
           ;; next.
           (let ((wall (get-internal-real-time)))
             (when (and (not resting)
                        (>= (* us-per-unit (- wall (load-history-last-wall history)))
                           (* 1000 +sample-ms+)))
               (let* ((load (note-load history (process-cpu-us) wall cpus))
                      ;; (A sample in which a garbage collection stopped every
                      ;; thread but one says nothing about blocked handlers:
                      ;; skipped.)
                      (collected (/= (shiftf last-gc sb-ext:*gc-run-time*) last-gc)))
                 (loop for group across groups
                       do (setf (group-idle-samples group)
                                (if (plusp (group-idle group)) (1+ (group-idle-samples group)) 0)
                                (group-busy-samples group)
                                (if (zerop (group-idle group)) (1+ (group-busy-samples group)) 0))
                          (unless collected
                            (resize-group pool group load share stat-buffer
                                          found brief-waits cpus-idle)))
                 (when (and (> (length groups) 1) (pool-maker-helps pool))
                   (help-busy-groups pool events))
                 ;; Still: no event begun or ended since the last sample,
                 ;; every holder waiting (under load, the sum is not read).
                 (if (all-holders-idle-p pool)
                     (let ((served (events-served pool)))
                       (setf still-samples (if (= served last-served) (1+ still-samples) 0)
                             last-served served))
                     (setf still-samples 0))
                 (when (and (>= still-samples +still-samples-before-rest+)
                            (rest-maker-p pool share))
                   (setf resting t))))))
      (free-event-buffer events))))

(defun events-served (pool)
  "The sum of POOL's workers' SERVING counts, which changes whenever one of
them begins or ends an event (or a worker comes or goes)."
  (sb-thread:with-mutex ((pool-lock pool))
    (let ((sum 0))
      (declare (type fixnum sum))
      (dolist (worker (pool-workers pool) sum)
        (setf sum (logand most-positive-fixnum (+ sum (worker-serving worker))))))))

(defun all-holders-idle-p (pool)
  "True when every permit holder of every group of POOL waits in epoll_wait."
  (every (lambda (group) (= (group-idle group) (group-holders group)))
         (pool-groups pool)))

(defun rest-maker-p (pool share)
  "Called by the maker after a sample that ends +STILL-SAMPLES-BEFORE-REST+
still ones (the last found every permit holder in epoll_wait): true, with
MAKER-RESTING set, when it may rest (see RESTING in the header): no group
has permits above SHARE to give back, and every permit holder still waits
in epoll_wait once MAKER-RESTING is set."
  (when (every (lambda (group) (<= (group-allowed group) share)) (pool-groups pool))
    (setf (pool-maker-resting pool) t)
    ;; Then the groups' IDLE, after a fence: a worker that left epoll_wait
    ;; before this read is seen here, one that leaves after it sees
    ;; MAKER-RESTING (WAKE-RESTING-MAKER).
    (sb-thread:barrier (:memory))
    (or (all-holders-idle-p pool)
        ;; A worker left: no rest.  (When it already took MAKER-RESTING
        ;; back, it also signalled: the maker's next wait returns at once.)
        (progn (sb-ext:compare-and-swap (pool-maker-resting pool) t nil)
               nil))))

(declaim (inline wake-resting-maker))
(defun wake-resting-maker (pool)
  "Called by a worker that just left epoll_wait with work (after its atomic
decrement of its group's IDLE, which fences): wake the maker if it rests."
  (when (and (pool-maker-resting pool)
             (sb-ext:compare-and-swap (pool-maker-resting pool) t nil))
    (sb-thread:signal-semaphore (pool-maker-semaphore pool))))

(defvar *sizing-trace* nil
  "NIL, or a function the maker calls with each group's index, its
SIZING-SAMPLE, its SIZING-STATE before, the decision and what the look
was asked and found (a list: LIMIT BLOCKED SATURATED BLOCKED-TO-CONFIRM
CONFIRMED, NIL where not asked): how tests/data/sizing/ was recorded
\(bench/record-sizing.lisp).")

(defun resize-group (pool group load share stat-buffer found brief-waits cpus-idle)
  "Sample GROUP, ask the sizing policy (DECIDE-SIZE, sizing.lisp) and act on
its decision.  LOAD is the process's share of its CPUs over the last
samples (NOTE-LOAD), SHARE the group's share of them; FOUND and BRIEF-WAITS
are the maker's, for CONFIRMED-BLOCKED; CPUS-IDLE true when the CPUs were
idle lately (cpus.lisp)."
  (let* ((seen (list nil nil nil nil nil))
         (sample (make-sizing-sample
                  :idle (group-idle group) :holders (group-holders group)
                  :allowed (group-allowed group) :threads (group-thread-count group)
                  :share share :idle-samples (group-idle-samples group)
                  :load load :cpus-idle cpus-idle
                  :room-for-permit (< (pool-run-permits pool) (pool-max-threads pool))
                  :room-for-thread (< (pool-thread-count pool) (pool-max-threads pool))
                  :look (lambda (limit)
                          (multiple-value-bind (blocked saturated)
                              (blocked-workers pool group limit share stat-buffer found cpus-idle)
                            (setf (first seen) limit (second seen) blocked (third seen) saturated)
                            (values blocked saturated)))
                  :confirm (lambda (blocked)
                             (setf (fourth seen) blocked
                                   (fifth seen)
                                   (confirmed-blocked found blocked stat-buffer brief-waits
                                                      (now-ms))))))
         (before (group-sizing group)))
    (multiple-value-bind (decision state) (decide-size sample before)
      (setf (group-sizing group) state)
      (when *sizing-trace*
        (funcall *sizing-trace* (group-index group) sample before decision seen))
      (ecase decision
        (:hold)
        (:add-permit
         ;; (Threads read again: one may have left during the look.)
         (when (>= (group-thread-count group) (group-allowed group))
           (add-permit group))
         (when (< (group-thread-count group) (group-allowed group))
           (spawn-worker pool group)))
        (:add-thread (spawn-worker pool group))
        (:remove-permit
         (setf (group-idle-samples group) 0)
         (remove-permit group))))))

(defun help-busy-groups (pool events)
  "STEALING (see the header): for each group busy (no worker idle) in two
samples in a row, move what waits in its epoll set and on its READY queue to
the READY queue of the group with the most idle workers, if one has any,
and nudge that group.  This is for a group whose workers all block while
the others sleep, so that no worker goes idle to steal for it: its
connections wait about two samples (10 ms), not for as long as its handlers
block, even when the pool may not grow.  EVENTS is the maker's event
buffer."
  (let ((groups (pool-groups pool)))
    (loop for busy across groups
          when (>= (group-busy-samples busy) 2)
            do (let ((helper (reduce (lambda (a b) (if (> (group-idle b) (group-idle a)) b a))
                                     groups)))
                 (when (and (not (eq helper busy)) (plusp (group-idle helper)))
                   (let ((moved 0)
                         (ready (group-ready helper)))
                     (declare (type fixnum moved))
                     ;; The set first: a nudge taken from it was for what the
                     ;; queue holds, which moves after it.
                     (let ((n (epoll-wait (group-epfd busy) events +batch+ 0)))
                       (dotimes (i n)
                         (let ((item (take-from-other-set busy events i)))
                           (when item
                             (sb-concurrency:enqueue item ready)
                             (incf moved)))))
                     ;; At most a few batches a sample: the busy group's
                     ;; workers may queue as fast as this moves.
                     (loop repeat (* 4 +batch+)
                           do (multiple-value-bind (item found)
                                  (sb-concurrency:dequeue (group-ready busy))
                                (unless found (return))
                                (sb-concurrency:enqueue item ready)
                                (incf moved)))
                     (when (plusp moved)
                       (incf (pool-moved pool) moved)
                       (signal-eventfd (group-nudge-fd helper)))))))))

(defun blocked-workers (pool group limit cpus buffer &optional found cpus-idle)
  "How many of POOL's workers in GROUP (all of them, when GROUP is NIL) are
blocked while serving an event: serving the same event (WORKER-SERVING odd
and unchanged) before and after a read of its thread's state that is not R
\(running, or runnable and waiting for a CPU: contention, not blocking),
counting no further than
LIMIT; 0 when more than +RUNNABLE-PER-CPU+ times CPUS of the serving
workers read are runnable \(state R) and CPUS-IDLE is false: the CPUs are
taken, by this process or by others, and another thread would only wait for
one too; then the second value is true.  CPUS-IDLE true says the CPUs were
idle lately (IDLE-METER-SHARE in cpus.lisp): runnable workers are then a
burst of wake-ups, not a queue for the CPUs.  BUFFER is for
THREAD-RUNNABLE-P.  FOUND, a simple vector, receives the workers counted and
the events they serve, a pair each, as far as it holds them (for
CONFIRMED-BLOCKED)."
  (let ((count 0) (runnable 0))
    (declare (type fixnum count runnable))
    (when (plusp limit)
      (dolist (worker (sb-thread:with-mutex ((pool-lock pool))
                        (copy-list (pool-workers pool))))
        (when (or (null group) (eq group (worker-group worker)))
          (let ((before (worker-serving worker)))
            (when (oddp before)
              (cond ((thread-runnable-p (worker-stat-path worker) buffer)
                     (when (and (> (incf runnable) (* +runnable-per-cpu+ cpus))
                                (not cpus-idle))
                       (return-from blocked-workers (values 0 t))))
                    ((= before (worker-serving worker))
                     (when (and found (< (1+ (* 2 count)) (length found)))
                       (setf (svref found (* 2 count)) worker
                             (svref found (1+ (* 2 count))) before))
                     (when (>= (incf count) limit)
                       (return)))))))))
    (values count nil)))

(defun world-lock-held-elsewhere-p (thread)
  "True when a thread other than THREAD holds SBCL's world lock: it compiles,
or fills the caches of generic functions called for the first time (a
server's first requests make many such calls).  Any thread that compiles or
calls such a function meanwhile waits for it in futex(2), however long that
takes beside another busy process, and a thread added to serve would only
wait too."
  (let ((owner (sb-thread:mutex-owner sb-kernel::**world-lock**)))
    (and owner (not (eq owner thread)))))

(defun confirmed-blocked (found count buffer brief-waits now)
  "Of the COUNT blocked workers BLOCKED-WORKERS put in FOUND, how many are
blocked inside a system call other than futex(2), or waiting briefly
\(THREAD-WAIT-KIND: inside futex(2), or outside any call) on an event on
which they were found so at least +BRIEF-WAIT-MS+ before NOW (NOW-MS).
BRIEF-WAITS, an EQ hash table of the maker's, holds for each worker found
waiting so the event and the time it was first found so; it is updated
here.  A wait on a lock whose holder was preempted (on a machine shared
with other processes: a lock the handlers share, the allocator's, or the
address space's in a page fault) lasts until that holder gets a CPU again,
and a thread added for it would only wait on the same lock; a handler
waiting on a semaphore or condition for its database is still there later.
A futex(2) wait while another thread holds the world lock is not counted
\(WORLD-LOCK-HELD-ELSEWHERE-P), though it keeps its age.  A worker found
running again is not blocked; one whose syscall file can't be read counts,
as its state said.  BUFFER is for THREAD-WAIT-KIND."
  (let ((confirmed 0))
    (declare (type fixnum confirmed))
    (when (> (hash-table-count brief-waits) 1024)
      (clrhash brief-waits))            ; workers that left
    (dotimes (i (min count (floor (length found) 2)))
      (let ((worker (svref found (* 2 i)))
            (event (svref found (1+ (* 2 i)))))
        (case (thread-wait-kind (worker-syscall-path worker) buffer)
          (:running (remhash worker brief-waits))
          (:brief (let ((seen (gethash worker brief-waits)))
                    (cond ((not (and seen (eql event (car seen))))
                           (setf (gethash worker brief-waits) (cons event now)))
                          ((world-lock-held-elsewhere-p (worker-thread worker)))
                          ((>= (- now (cdr seen)) +brief-wait-ms+)
                           (incf confirmed)))))
          (t (remhash worker brief-waits)
           (incf confirmed)))
        (setf (svref found (* 2 i)) nil)))
    confirmed))

(defun join-workers (pool worker)
  (sb-thread:with-mutex ((pool-lock pool))
    (push worker (pool-workers pool))))

(defun leave-pool (pool group already-counted-out worker)
  (let ((self sb-thread:*current-thread*))
    (sb-thread:with-mutex ((pool-lock pool))
      (setf (pool-workers pool) (delete worker (pool-workers pool)))
      (cond ((member self (pool-threads pool))
             (setf (pool-threads pool) (delete self (pool-threads pool)))
             (unless already-counted-out
               (decf (pool-thread-count pool))
               (decf (group-thread-count group)))
             (push self (pool-retired pool)))
            ((member self (pool-outside pool))
             ;; Stepped out (POOL-STEP-OUT): counted out then.
             (setf (pool-outside pool) (delete self (pool-outside pool)))
             (push self (pool-retired pool)))))))

(defun try-retire (pool group)
  "Leave the pool if GROUP has more than its share of STANDBY-THREADS workers.
True if leaving."
  (sb-thread:with-mutex ((pool-lock pool))
    (when (> (group-thread-count group) (group-standby-threads group))
      (decf (pool-thread-count pool))
      (decf (group-thread-count group))
      t)))

(defun acquire-permit (pool group)
  "Wait for a run permit of GROUP.  True with one; NIL when stopping, or
:RETIRED when no permit came for THREAD-IDLE-TIMEOUT-MS and this thread may leave
the pool (then it was counted out of THREAD-COUNT)."
  (loop
    (when (pool-stopping pool)
      (return nil))
    (cond ((sb-thread:wait-on-semaphore (group-permits group)
                                        :timeout (/ (pool-thread-idle-timeout-ms pool) 1000))
           (when (pool-stopping pool)
             (sb-thread:signal-semaphore (group-permits group))
             (return nil))
           (sb-ext:atomic-incf (group-holders group))
           (return t))
          ((try-retire pool group)
           (return :retired)))))

(defun surplus-holder-p (group)
  "True, having given up this worker's permit, when more workers of GROUP hold
permits than its ALLOWED."
  (loop
    (let ((holders (group-holders group)))
      (when (<= holders (group-allowed group))
        (return nil))
      (when (eql holders (sb-ext:compare-and-swap (group-holders group) holders (1- holders)))
        (return t)))))

(defun release-permit (group)
  (sb-ext:atomic-decf (group-holders group))
  (sb-thread:signal-semaphore (group-permits group)))

(defun worker-loop (pool group)
  (let ((*worker-pool* pool)
        (*worker-locals* (make-array 2 :initial-element nil))
        (events (make-event-buffer +batch+))
        (epfd (group-epfd group))
        (ready (group-ready group))
        (nudge-fd (group-nudge-fd group))
        (dispatch (pool-dispatch pool))
        (timeout (pool-thread-idle-timeout-ms pool))
        (counted-out nil)
        (holding nil)
        (stepped-out nil)
        (*step-out* nil)
        (stealing (> (length (pool-groups pool)) 1))
        (worker (make-worker sb-thread:*current-thread*
                             (sb-thread:thread-os-tid sb-thread:*current-thread*)
                             group)))
    (declare (type function dispatch) (type fixnum epfd nudge-fd timeout))
    (join-workers pool worker)
    (setf *step-out*
          (lambda ()
            (unless stepped-out
              (setf stepped-out t)
              (sb-thread:with-mutex ((pool-lock pool))
                (setf (pool-workers pool) (delete worker (pool-workers pool)))
                ;; Counted out now; a thread so new that SPAWN-WORKER has
                ;; not listed it in THREADS yet stays there until it exits.
                (decf (pool-thread-count pool))
                (decf (group-thread-count group))
                (when (member sb-thread:*current-thread* (pool-threads pool))
                  (setf (pool-threads pool) (delete sb-thread:*current-thread* (pool-threads pool)))
                  (push sb-thread:*current-thread* (pool-outside pool))))
              (when holding
                (setf holding nil)
                (release-permit group))
              ;; Not left to the maker: it adds threads only for a group it
              ;; finds blocked two samples in a row, one a sample, and many
              ;; WebSockets open at once.
              (when (zerop (group-idle group))
                (spawn-worker pool group)))
            t))
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
             (let ((first nil) (first-flags 0) (queued 0) (nudged nil))
               (declare (type fixnum queued))
               (dotimes (i n)
                 (let ((data (event-data events i)))
                   (cond ((= data +wake-data+) (return-from take-events :wake))
                         ((= data +nudge-data+)
                          ;; A nudge says the queue holds work for a worker in
                          ;; epoll_wait.  This one serves the queue next only
                          ;; when it keeps no event for itself.
                          (setf nudged t))
                         ((and keep-first (null first))
                          (setf first data
                                first-flags (event-flags events i)))
                         (t (sb-concurrency:enqueue (encode-event data (event-flags events i))
                                                    ready)
                            (incf queued)))))
               (when (or (plusp queued)
                         ;; A nudge taken by a look without waiting, or with
                         ;; an event this worker serves first (and which may
                         ;; block): pass it on, or what it announced would
                         ;; wait for that worker while others sleep in
                         ;; epoll_wait.
                         (and nudged (or (not keep-first) first)
                              (not (sb-concurrency:queue-empty-p ready))))
                 (cond ((plusp (group-idle group))
                        (signal-eventfd nudge-fd))
                       ((and stealing (plusp queued))
                        ;; None of this group waits (IDLE read as 0 after
                        ;; the enqueue): one of another group's idle workers
                        ;; takes from this queue (STEALING).
                        (nudge-idle-group pool group))))
               (values first first-flags))))
      (unwind-protect
           (with-thread-buffers
            (loop
             (unless holding
               (let ((permit (acquire-permit pool group)))
                 (case permit
                   ((nil) (return))
                   (:retired (setf counted-out t) (return))
                   (t (setf holding t)))))
             (let ((polled nil)
                   ;; Whether others of this group waited in epoll_wait
                   ;; when this worker counted itself idle.
                   (crowd nil))
               (multiple-value-bind (queued found) (sb-concurrency:dequeue ready)
                 (when (and found (plusp (group-idle group))
                            (not (sb-concurrency:queue-empty-p ready)))
                   ;; More queued than this worker will serve now: pass the
                   ;; nudge on, so one nudge per batch wakes as many as needed.
                   (signal-eventfd nudge-fd))
                 (unless found
                   ;; Count this worker idle, then look once more: an event
                   ;; queued in between saw it idle and nudged, or is found
                   ;; here.  It stays counted until it leaves epoll_wait, so
                   ;; that whatever is queued from now on nudges.
                   (setf crowd (> (sb-ext:atomic-incf (group-idle group)) 0))
                   (multiple-value-setq (queued found) (sb-concurrency:dequeue ready))
                   (when found
                     (sb-ext:atomic-decf (group-idle group))
                     (wake-resting-maker pool))
                   ;; STEALING: with nothing queued here, this group's own
                   ;; set first, without waiting (what it holds comes
                   ;; before another group's work, and when it holds
                   ;; something this costs no more than the wait it
                   ;; replaces); then one item of another group's queue,
                   ;; else one event waiting in another group's set, else
                   ;; the wait.  While others of this group wait already
                   ;; (CROWD), no look at a set where a worker waits, this
                   ;; group's included: the kernel wakes that worker for
                   ;; each event, and a look would take the event it was
                   ;; woken for (two system calls, and a wake-up for
                   ;; nothing).
                   (when (and (not found) stealing)
                     (let ((n (if crowd 0 (epoll-wait epfd events +batch+ 0))))
                       (if (plusp n)
                           (setf polled n)
                           (multiple-value-bind (item took)
                               (steal-one pool group events (ash (worker-serving worker) -1)
                                          crowd)
                             (when took
                               (sb-ext:atomic-decf (group-idle group))
                               (wake-resting-maker pool)
                               (sb-ext:atomic-incf (pool-stolen pool))
                               (setf queued item
                                     found t)))))))
                 (cond ((functionp queued)
                        ;; A timer's thunk (POOL-SUBMIT).
                        (serve queued 0))
                       ((consp queued)
                        ;; A connection that served its turn (GROUP-REQUEUE).
                        ;; The queue may never empty while clients pipeline:
                        ;; look at epoll first, without waiting, so that new
                        ;; events queue up now, before its next turn.
                        (when (eq :wake (take-events (epoll-wait epfd events +batch+ 0) nil))
                          (return))
                        (serve (car queued) +epollin+))
                       (found
                        (serve (queued-event-data queued) (queued-event-flags queued)))
                       (t
                        ;; Counted idle above.  POLLED: events the look
                        ;; before stealing found.
                        (let ((started (now-ms)))
                          (let ((n (or polled
                                       (epoll-wait epfd events
                                                   ;; Others of the group wait
                                                   ;; too: one event each, as
                                                   ;; the kernel wakes one
                                                   ;; waiter per event.
                                                   (if crowd 1 +batch+)
                                                   timeout))))
                            (sb-ext:atomic-decf (group-idle group))
                            ;; (Not for a wait that timed out: no work.)
                            (when (plusp n)
                              (wake-resting-maker pool))
                            (when (pool-stopping pool)
                              (return))
                            (when (and (zerop n)
                                       (>= (- (now-ms) started) timeout)
                                       (try-retire pool group))
                              (setf counted-out t)
                              (return))
                            (multiple-value-bind (first first-flags) (take-events n t)
                              (case first
                                ((nil))
                                (:wake (return))
                                (t (serve first first-flags))))))))))
             (when stepped-out
               ;; Out of the pool's count since POOL-STEP-OUT: leave.
               (setf counted-out t)
               (return))
             (when (surplus-holder-p group)
               (setf holding nil))))
        (when holding
          (release-permit group))
        (free-event-buffer events)
        (leave-pool pool group counted-out worker)))))

(defun group-with-work (pool group)
  "Another group of POOL than GROUP whose READY queue holds work, or NIL."
  (loop for other across (pool-groups pool)
        unless (or (eq other group) (sb-concurrency:queue-empty-p (group-ready other)))
          return other))

(defconstant +sets-looked-at+ 2
  "The most other groups' epoll sets an idle worker looks at before it waits
\(STEALING): each look is a system call, and with many groups looking at
all of them would cost more than the wait saves.")

(defun steal-one (pool group events turn busy-only)
  "For an idle worker of GROUP (STEALING): one item of another group's READY
queue, or one event waiting in one of the next +SETS-LOOKED-AT+ other
groups' epoll sets from TURN (a number that changes from call to call, so
that the sets looked at rotate), taken with epoll_wait without waiting,
into EVENTS, and returned as ENCODE-EVENT encodes it; when BUSY-ONLY, only
the sets of groups none of whose workers waits in epoll_wait.  Second value:
true if something was taken.  Its system calls are paid only when a worker
runs out of work."
  (declare (type sb-ext:word turn))
  (let ((victim (group-with-work pool group)))
    (when victim
      (multiple-value-bind (item took) (sb-concurrency:dequeue (group-ready victim))
        (when took
          (return-from steal-one (values item t))))))
  (loop with groups = (pool-groups pool)
        with n = (length groups)
        with looked = 0
        for i from 0 below n
        for other = (svref groups (mod (+ turn i) n))
        while (< looked +sets-looked-at+)
        unless (or (eq other group) (and busy-only (plusp (group-idle other))))
          do (incf looked)
             ;; Up to twice: the first event may be OTHER's nudge (edge-
             ;; triggered, for its idle workers; when it has none, it was
             ;; signalled for work they will not take) or its wake, neither
             ;; of which TAKE-FROM-OTHER-SET takes, and an event behind it
             ;; would wait for the maker's help.
             (loop repeat 2
                   while (= 1 (epoll-wait (group-epfd other) events 1 0))
                   do (let ((item (take-from-other-set other events 0)))
                        (when item
                          (return-from steal-one (values item t))))))
  (values nil nil))

(defun nudge-idle-group (pool group)
  "Nudge an idle worker of another group of POOL than GROUP, if one is idle:
GROUP queued work none of its workers waits for (STEALING)."
  (loop for other across (pool-groups pool)
        when (and (not (eq other group)) (plusp (group-idle other)))
          do (signal-eventfd (group-nudge-fd other))
             (return)))

(defun group-requeue (group data)
  "Queue DATA for a worker of GROUP as if epoll had just reported it readable,
behind the events already queued (a connection that has served its turn, see
YIELD-TURN).  The caller has given the connection up."
  (sb-concurrency:enqueue (list data) (group-ready group)) ; a list: see WORKER-LOOP
  (when (plusp (group-idle group))
    (signal-eventfd (group-nudge-fd group))))

(defun pool-submit (pool thunk)
  "Queue THUNK for the next free worker (a timer that came due, see
timers.lisp), behind the events already queued: in a group with an idle
worker if there is one, else in each group in turn."
  (let* ((groups (pool-groups pool))
         (group (or (find-if (lambda (g) (plusp (group-idle g))) groups)
                    (pool-next-group pool))))
    (sb-concurrency:enqueue thunk (group-ready group)) ; a function: see WORKER-LOOP
    (when (plusp (group-idle group))
      (signal-eventfd (group-nudge-fd group)))))

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
