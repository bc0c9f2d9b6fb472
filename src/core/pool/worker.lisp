;;;; worker.lisp -- a worker thread: its run permit, its coming and going,
;;;; and its loop, one turn a list of named phases.
;;;;
;;;; WORKERS of a group are leaders/followers: an idle one waits in
;;;; epoll_wait and serves what it gets in place.  Connections are registered
;;;; once, edge-triggered; any worker may serve any of them.  A lone waiter
;;;; takes up to +BATCH+ events and queues all but the first on READY; one
;;;; that waits beside others (CROWD) takes one (doc/design.md, "One event
;;;; per waiter").  Workers empty READY before they wait (groups.lisp).
;;;;
;;;; RUN PERMITS.  A group's ALLOWED bounds how many of its workers wait in
;;;; or serve from epoll at once; its other threads wait for a permit
;;;; (ACQUIRE-PERMIT).  ALLOWED starts at the group's share of the usable
;;;; CPUs (GROUP-CPU-SHARE); the maker adds and takes back permits
;;;; (maker.lisp); a holder above ALLOWED gives its permit up at the end of
;;;; its turn (SURPLUS-HOLDER-P).  Once the pool runs, only the maker starts
;;;; threads (SBCL starts them under one global mutex), and a worker that
;;;; steps out (POOL-STEP-OUT) while none of its group is idle starts its
;;;; replacement; a thread idle for THREAD-IDLE-TIMEOUT-MS leaves while its
;;;; group has more than its share of STANDBY-THREADS (TRY-RETIRE).
;;;;
;;;; Invariants:
;;;;  - A group's IDLE (in epoll_wait) and HOLDERS (holding a permit) change
;;;;    only atomically; HOLDERS + free PERMITS = ALLOWED once surplus holders
;;;;    gave theirs up (SURPLUS-HOLDER-P).
;;;;  - A worker counts itself idle (GO-IDLE) before its last look at READY
;;;;    and counts itself out once it leaves epoll_wait or takes work, with an
;;;;    atomic decrement that fences before WAKE-RESTING-MAKER.
;;;;  - WORKER-SERVING is odd exactly while the worker serves an event or a
;;;;    timer (SERVE-ITEM): what the maker reads to find blocked workers.
;;;;  - Once STOPPING, the wake eventfd (level-triggered, in every set) stays
;;;;    readable: every worker exits once its current event is served.
;;;;
;;;; The phases of a turn are declared inline: WORKER-LOOP runs once per
;;;; event, and a phase adds no call, allocation or dispatch to it.

(in-package #:gallop.core)

;;; Run permits

(defun add-permit (group)
  "One more run permit for GROUP (the maker's, RESIZE-GROUP)."
  (incf (group-allowed group))
  (sb-thread:signal-semaphore (group-permits group)))

(defun remove-permit (group)
  "Take one permit of GROUP back: a free one at once, else the next holder to
notice gives its up."
  (decf (group-allowed group))
  (sb-thread:try-semaphore (group-permits group)))

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
  "Give this worker's run permit of GROUP back, for a thread that waits for
one."
  (sb-ext:atomic-decf (group-holders group))
  (sb-thread:signal-semaphore (group-permits group)))

;;; Workers coming and going

(defun join-workers (pool worker)
  "List WORKER, the record of a worker that begins its loop, in POOL's
WORKERS, where the maker reads it."
  (sb-thread:with-mutex ((pool-lock pool))
    (push worker (pool-workers pool))))

(defun leave-pool (pool group already-counted-out worker)
  "The last act of a worker of GROUP whose loop ended: out of WORKERS and of
THREADS (or OUTSIDE, once stepped out), counted out of THREAD-COUNT unless
ALREADY-COUNTED-OUT, and onto RETIRED, for the maker or POOL-STOP to join."
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

(defun join-retired (pool)
  "Join the threads of POOL that left (RETIRED).  The maker calls this every
+SAMPLE-MS+: no lock when there is nothing to join (a thread that retires
after this look is joined at the next)."
  (let ((retired (and (pool-retired pool)
                      (sb-thread:with-mutex ((pool-lock pool))
                        (shiftf (pool-retired pool) '())))))
    (dolist (thread retired)
      (sb-thread:join-thread thread :default nil))))

(defun spawn-worker (pool group)
  "Start one worker in GROUP unless the pool is full or stopping.  Called from
the maker thread, from POOL-START, or by a worker that steps out."
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

(defun step-out-of-count (pool group worker)
  "For a worker of GROUP stepping out (POOL-STEP-OUT): out of WORKERS and of
THREAD-COUNT now, and from THREADS into OUTSIDE, where POOL-STOP still joins
it.  A thread so new that SPAWN-WORKER has not listed it in THREADS yet
stays there until it exits (LEAVE-POOL then counts it out no more)."
  (sb-thread:with-mutex ((pool-lock pool))
    (setf (pool-workers pool) (delete worker (pool-workers pool)))
    (decf (pool-thread-count pool))
    (decf (group-thread-count group))
    (when (member sb-thread:*current-thread* (pool-threads pool))
      (setf (pool-threads pool) (delete sb-thread:*current-thread* (pool-threads pool)))
      (push sb-thread:*current-thread* (pool-outside pool)))))

(declaim (inline wake-resting-maker))
(defun wake-resting-maker (pool)
  "Called by a worker that just left epoll_wait with work (after its atomic
decrement of its group's IDLE, which fences): wake the maker if it rests
\(RESTING in maker.lisp; the maker's side is REST-MAKER-P)."
  (when (and (pool-maker-resting pool)
             (sb-ext:compare-and-swap (pool-maker-resting pool) t nil))
    (sb-thread:signal-semaphore (pool-maker-semaphore pool))))

;;; The phases of a worker's turn, in the order WORKER-LOOP runs them

(declaim (inline take-ready go-idle look-elsewhere take-events take-requeued
                 wait-for-events serve-item))

(defun take-ready (group ready nudge-fd)
  "Phase 2: one item of GROUP's READY queue (its READY and NUDGE-FD, which
the loop keeps at hand); second value true if one was taken.  When more are
queued than this worker will serve now and a worker of GROUP waits in
epoll_wait, nudge it: so one nudge per batch wakes as many as needed, each
passing it on."
  (declare (type fixnum nudge-fd))
  (multiple-value-bind (item found) (sb-concurrency:dequeue ready)
    (when (and found (plusp (group-idle group))
               (not (sb-concurrency:queue-empty-p ready)))
      (signal-eventfd nudge-fd))
    (values item found)))

(defun go-idle (pool group ready)
  "Phase 3, READY found empty: count this worker idle in GROUP, then look at
READY once more.  An item queued in between saw this worker idle and
nudged, or is found here (the invariant of groups.lisp); the worker stays
counted idle until it leaves epoll_wait or takes work, so that whatever is
queued from now on nudges.  Values: the item and true if one was found
\(then counted out of IDLE again, the maker woken if it rests), and CROWD:
true when others of GROUP already waited in epoll_wait."
  (let ((crowd (> (sb-ext:atomic-incf (group-idle group)) 0)))
    (multiple-value-bind (item found) (sb-concurrency:dequeue ready)
      (when found
        (sb-ext:atomic-decf (group-idle group))
        (wake-resting-maker pool))
      (values item found crowd))))

(defun look-elsewhere (pool group worker epfd events crowd)
  "Phase 4, with more than one group and still nothing queued (STEALING in
groups.lisp): GROUP's own set first, without waiting (what it holds comes
before another group's work, and when it holds something this costs no more
than the wait it replaces); then one item of another group's queue, else one
event waiting in another group's set (STEAL-ONE).  While others of GROUP
wait already (CROWD), no look at a set where a worker waits, GROUP's
included: the kernel wakes that worker for each event, and a look would take
the event it was woken for (two system calls, and a wake-up for nothing).
Values: the count of events the look at GROUP's set left in EVENTS (or NIL),
the item stolen, and true if one was (then counted out of IDLE)."
  (declare (type fixnum epfd))
  (let ((n (if crowd 0 (epoll-wait epfd events +batch+ 0))))
    (if (plusp n)
        (values n nil nil)
        (multiple-value-bind (item took)
            (steal-one pool group events (ash (worker-serving worker) -1) crowd)
          (when took
            (sb-ext:atomic-decf (group-idle group))
            (wake-resting-maker pool)
            (sb-ext:atomic-incf (pool-stolen pool)))
          (values nil item took)))))

(defun take-events (pool group events n keep-first stealing ready nudge-fd)
  "Take the N events epoll_wait left in EVENTS from GROUP's set: queue them on
READY (GROUP's), but the first connection's when KEEP-FIRST: that one is
returned (with its flags), for this worker to serve at once.  :WAKE when the
pool is stopping.  Whoever queues while others of GROUP wait nudges one;
when none waits and STEALING, one of another group's idle workers."
  (declare (type fixnum n nudge-fd))
  (let ((first nil) (first-flags 0) (queued 0) (nudged nil))
    (declare (type fixnum queued))
    (dotimes (i n)
      (let ((data (event-data events i)))
        (cond ((= data +wake-data+) (return-from take-events :wake))
              ((= data +nudge-data+)
               ;; A nudge says the queue holds work for a worker in
               ;; epoll_wait.  This one serves the queue next only when it
               ;; keeps no event for itself.
               (setf nudged t))
              ((and keep-first (null first))
               (setf first data
                     first-flags (event-flags events i)))
              (t (sb-concurrency:enqueue (encode-event data (event-flags events i)) ready)
                 (incf queued)))))
    (when (or (plusp queued)
              ;; A nudge taken by a look without waiting, or with an event
              ;; this worker serves first (and which may block): pass it on,
              ;; or what it announced would wait for that worker while
              ;; others sleep in epoll_wait.
              (and nudged (or (not keep-first) first)
                   (not (sb-concurrency:queue-empty-p ready))))
      (cond ((plusp (group-idle group))
             (signal-eventfd nudge-fd))
            ((and stealing (plusp queued))
             ;; None of this group waits (IDLE read as 0 after the enqueue):
             ;; one of another group's idle workers takes from this queue
             ;; (STEALING).
             (nudge-idle-group pool group))))
    (values first first-flags)))

(defun take-requeued (pool group item events epfd stealing ready nudge-fd)
  "Phase 5 for ITEM, a connection that served its turn (GROUP-REQUEUE: a
list of its data).  The queue may never empty while clients pipeline: look
at epoll first, without waiting, so that new events queue up now, before its
next turn.  Values: the data and flags to serve, and :STOP when the look
found the pool stopping."
  (declare (type fixnum epfd))
  (if (eq :wake (take-events pool group events (epoll-wait epfd events +batch+ 0) nil
                             stealing ready nudge-fd))
      (values nil 0 :stop)
      (values (car item) +epollin+ nil)))

(defun wait-for-events (pool group events epfd polled crowd timeout stealing ready
                        nudge-fd)
  "Phase 5 with nothing found: wait in GROUP's set (counted idle since
GO-IDLE) up to TIMEOUT ms, unless the look of LOOK-ELSEWHERE already found
POLLED events; then count this worker out of IDLE.  A lone waiter takes up
to +BATCH+ events, one in a CROWD one, as the kernel wakes one waiter per
event; the first is served here, the others queued (TAKE-EVENTS).  Values:
the data and flags to serve (NIL for none), and :STOP when the pool is
stopping, or :RETIRED when the wait timed out and the thread may leave (it
was counted out of THREAD-COUNT, TRY-RETIRE)."
  (declare (type fixnum epfd timeout))
  (let* ((started (now-ms))
         (n (or polled (epoll-wait epfd events (if crowd 1 +batch+) timeout))))
    (sb-ext:atomic-decf (group-idle group))
    ;; (Not for a wait that timed out: no work.)
    (when (plusp n)
      (wake-resting-maker pool))
    (cond ((pool-stopping pool) (values nil 0 :stop))
          ((and (zerop n)
                (>= (- (now-ms) started) timeout)
                (try-retire pool group))
           (values nil 0 :retired))
          (t (multiple-value-bind (first first-flags)
                 (take-events pool group events n t stealing ready nudge-fd)
               (if (eq first :wake)
                   (values nil 0 :stop)
                   (values first first-flags nil)))))))

(defun serve-item (pool worker dispatch data flags)
  "Phase 6: serve DATA, an event's (DISPATCH is called with it and FLAGS) or
a timer's thunk (POOL-SUBMIT), counted as serving in WORKER's SERVING (odd
meanwhile) so that one that blocks is seen blocked.  What escapes it goes
to the pool's LOG-ERROR: a worker outlives any handler."
  (declare (type function dispatch))
  (incf (worker-serving worker))
  (handler-case (if (functionp data)
                    (funcall data)
                    (funcall dispatch data flags))
    (serious-condition (e)
      (let ((log (pool-log-error pool)))
        (when log (ignore-errors (funcall log e))))))
  (incf (worker-serving worker)))

(defun worker-loop (pool group)
  "The life of a worker of GROUP: listed in POOL's WORKERS, it turns until the
pool stops, its idle timeout retires it, or it steps out; then it leaves
\(LEAVE-POOL).  One turn, in order:
  1. ACQUIRE-PERMIT, unless it holds one: wait for a run permit of GROUP.
  2. TAKE-READY: one item of GROUP's READY queue.
  3. GO-IDLE, with none: count itself idle and look once more.
  4. LOOK-ELSEWHERE, still none and more than one group: GROUP's own set
     without waiting, else another group's work (STEALING).
  5. What to serve: a timer's thunk as it is; a connection's turn after a
     look at the set (TAKE-REQUEUED); a queued event decoded; else
     WAIT-FOR-EVENTS in epoll_wait.
  6. SERVE-ITEM.
  7. Leave once stepped out; give the permit up when GROUP holds more than
     ALLOWED (SURPLUS-HOLDER-P).
Phases 2 to 6 are declared inline: they add no call to a turn."
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
              (step-out-of-count pool group worker)
              (when holding
                (setf holding nil)
                (release-permit group))
              ;; Not left to the maker: it adds threads only for a group it
              ;; finds blocked two samples in a row, one a sample, and many
              ;; WebSockets open at once.
              (when (zerop (group-idle group))
                (spawn-worker pool group)))
            t))
    (unwind-protect
         (with-thread-buffers
          (loop
           ;; 1.
           (unless holding
             (case (acquire-permit pool group)
               ((nil) (return))
               (:retired (setf counted-out t) (return))
               (t (setf holding t))))
           (let ((polled nil) (crowd nil))
             ;; 2. to 4.
             (multiple-value-bind (item found) (take-ready group ready nudge-fd)
               (unless found
                 (multiple-value-setq (item found crowd) (go-idle pool group ready))
                 (when (and (not found) stealing)
                   (multiple-value-setq (polled item found)
                     (look-elsewhere pool group worker epfd events crowd))))
               ;; 5.
               (multiple-value-bind (data flags leave)
                   (cond ((functionp item) (values item 0 nil))
                         ((consp item)
                          (take-requeued pool group item events epfd stealing ready
                                         nudge-fd))
                         (found (values (queued-event-data item) (queued-event-flags item)
                                        nil))
                         (t (wait-for-events pool group events epfd polled crowd timeout
                                             stealing ready nudge-fd)))
                 (case leave
                   ((nil))
                   (:retired (setf counted-out t) (return))
                   (t (return)))
                 ;; 6.
                 (when data
                   (serve-item pool worker dispatch data flags)))))
           ;; 7.
           (when stepped-out
             ;; Out of the pool's count since POOL-STEP-OUT: leave.
             (setf counted-out t)
             (return))
           (when (surplus-holder-p group)
             (setf holding nil))))
      (when holding
        (release-permit group))
      (free-event-buffer events)
      (leave-pool pool group counted-out worker))))
