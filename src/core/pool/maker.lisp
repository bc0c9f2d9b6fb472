;;;; maker.lisp -- the maker thread: it samples every group, sizes its run
;;;; permits and threads, moves the work of busy groups, and rests when the
;;;; pool is still.
;;;;
;;;; SIZING.  Every +SAMPLE-MS+ the maker samples each group and acts on what
;;;; the sizing policy decides (RESIZE-GROUP; the policy, a pure function,
;;;; and its constants are in sizing.lisp): a permit for workers the kernel
;;;; shows blocked in a handler (BLOCKED-WORKERS, CONFIRMED-BLOCKED), never
;;;; for ones waiting for a CPU; a permit back, down to the group's share of
;;;; the usable CPUs (GROUP-CPU-SHARE), when the CPUs are saturated, the
;;;; holders sat idle a second, or the extra permits cover no blocked
;;;; worker.  At most one change per group and sample, so that the effect
;;;; of the last change is measured before the next.  The maker starts the
;;;; threads the pool grows by and joins those that left (worker.lisp).
;;;;
;;;; RESTING.  After +STILL-SAMPLES-BEFORE-REST+ still samples the maker
;;;; sleeps up to a second at a time until a worker finds work.  Each side
;;;; writes its word, fences, then reads the other's, so no work begins
;;;; unseen (REST-MAKER-P, WAKE-RESTING-MAKER in worker.lisp; doc/design.md,
;;;; "A pool at rest").
;;;;
;;;; The maker's state lives in a MAKER record, read and written by the maker
;;;; thread alone.

(in-package #:gallop.core)

(defconstant +still-samples-before-rest+ 20
  "Samples of the maker in a row (100 ms) in which every permit holder of
the pool waited in epoll_wait and none of its workers began or ended an
event, after which the maker may rest (RESTING in the header): it then
waits up to a second at a time, doing only its once-a-second chores (the
CPUs, the retired threads), until a worker wakes it, and starts its samples
afresh.  At a few requests a second the maker so rests between them, woken
once a request; at more it does not rest.")


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


(defconstant +idle-read-units+ (* +idle-read-ms+ (/ internal-time-units-per-second 1000))
  "+IDLE-READ-MS+ in internal time units.")

(defstruct (maker (:constructor make-maker
                      (pool &aux (groups (pool-groups pool))
                                 (cpus (usable-cpus))
                                 (share (group-cpu-share cpus (length groups)
                                                         (pool-max-threads pool)))
                                 (mask (allowed-cpu-mask))
                                 (idle-meter (make-idle-meter))
                                 (idle-read (get-internal-real-time))
                                 (cpus-read (get-internal-real-time))
                                 (history (make-load-history (process-cpu-us)
                                                             (get-internal-real-time)))
                                 (last-gc sb-ext:*gc-run-time*)
                                 (stat-buffer (make-array 128 :element-type '(unsigned-byte 8)))
                                 (found (make-array (* 2 (pool-max-threads pool))
                                                    :initial-element nil))
                                 (brief-waits (make-hash-table :test 'eq))
                                 (events (make-event-buffer +batch+))))
                  (:copier nil))
  "What the maker thread of a pool carries from one turn of MAKER-LOOP to the
next; no other thread reads it."
  (groups #() :type simple-vector :read-only t) ; the pool's: their number stays
  ;; The usable CPUs (USABLE-CPUS), a group's share of them, the affinity
  ;; mask, and when they were read (internal real time): LOOK-AT-CPUS.
  cpus share mask cpus-read
  ;; The CPUs' idle time, when no quota applies (cpus.lisp): READ-IDLE-CPUS.
  (idle-meter nil :read-only t)
  (cpus-idle nil)
  idle-read
  ;; The process's CPU use (NOTE-LOAD), and the garbage collector's run time
  ;; at the last sample.
  (history nil :type load-history)
  last-gc
  (stat-buffer nil :read-only t)
  ;; For CONFIRMED-BLOCKED: the workers BLOCKED-WORKERS found, and those last
  ;; seen waiting briefly (THREAD-WAIT-KIND).
  (found nil :type simple-vector :read-only t)
  (brief-waits nil :read-only t)
  (events nil :read-only t)             ; for HELP-BUSY-GROUPS; freed at the end
  ;; RESTING (see the header), and the samples in a row in which no event
  ;; began or ended (EVENTS-SERVED), whose sum was LAST-SERVED.
  (resting nil)
  (still-samples 0 :type fixnum)
  (last-served -1 :type fixnum))

(defmethod print-object ((maker maker) stream)
  (print-unreadable-object (maker stream :type t :identity t)))

;;; The phases of the maker's turn, in the order MAKER-LOOP runs them

(defun look-at-cpus (pool maker)
  "Phase 1: once a second, read the usable CPUs again, and with them a
group's share and the affinity mask: they may change (taskset, a new cgroup
quota).  The number of groups stays."
  (when (>= (- (get-internal-real-time) (maker-cpus-read maker)) internal-time-units-per-second)
    (setf (maker-cpus maker) (usable-cpus)
          (maker-share maker) (group-cpu-share (maker-cpus maker) (length (maker-groups maker))
                                               (pool-max-threads pool))
          (maker-mask maker) (allowed-cpu-mask)
          (maker-cpus-read maker) (get-internal-real-time))))

(defun read-idle-cpus (maker)
  "Phase 2: every +IDLE-READ-MS+, unless resting, whether the CPUs were idle
lately (CPUS-IDLE: at least +IDLE-CPUS-SHARE+ of their time, IDLE-METER-SHARE
in cpus.lisp), known only when no quota applies (the mask's CPUs are all
usable): runnable workers are then a burst of wake-ups, not a queue for the
CPUs (BLOCKED-WORKERS)."
  (when (and (not (maker-resting maker))
             (>= (- (get-internal-real-time) (maker-idle-read maker)) +idle-read-units+))
    (let ((mask (maker-mask maker)))
      (setf (maker-idle-read maker) (get-internal-real-time)
            (maker-cpus-idle maker)
            (and (= (maker-cpus maker) (logcount mask)) ; no quota
                 (let ((idle (idle-meter-share (maker-idle-meter maker) mask)))
                   (and idle (>= idle +idle-cpus-share+))))))))

(defun wait-for-sample (pool maker)
  "Phase 3: wait +SAMPLE-MS+ (a second while resting), or until a worker wakes
the maker from its rest, or POOL-STOP does.  Workers do not wake the maker
per request: that would cost a context switch each."
  (sb-thread:wait-on-semaphore (pool-maker-semaphore pool)
                               :timeout (if (maker-resting maker) 1 (/ +sample-ms+ 1000))))

(defun collapse-wake-ups (pool)
  "Phase 6: wake-ups that piled up on the maker's semaphore collapse into
this one turn."
  (let ((piled (sb-thread:semaphore-count (pool-maker-semaphore pool))))
    (when (plusp piled)
      (sb-thread:try-semaphore (pool-maker-semaphore pool) piled))))

(defun end-rest-if-woken (pool maker)
  "Phase 7: when a worker woke the resting maker (it took MAKER-RESTING
back), the rest ends and the load's samples start afresh, over the time from
now on, not over the rest.  The CPUs' idle time is read at once, and that
reading covers the rest, when they were idle: a load that wakes the maker is
one that starts on idle CPUs."
  (when (and (maker-resting maker) (not (pool-maker-resting pool)))
    (let ((now (get-internal-real-time)))
      (setf (maker-resting maker) nil
            (maker-still-samples maker) 0
            (maker-history maker) (make-load-history (process-cpu-us) now)
            (maker-idle-read maker) (- now +idle-read-units+)
            (maker-last-gc maker) sb-ext:*gc-run-time*))))

(defun sample-due-p (maker wall)
  "Phase 8's test: true when the maker does not rest and +SAMPLE-MS+ passed
since the last sample, as of WALL (internal real time)."
  (and (not (maker-resting maker))
       (>= (* (/ 1000000 internal-time-units-per-second)
              (- wall (load-history-last-wall (maker-history maker))))
           (* 1000 +sample-ms+))))

(defun note-group-sample (group)
  "Count this sample in GROUP's samples in a row with an idle worker
\(IDLE-SAMPLES, for the sizing policy) and with none (BUSY-SAMPLES, for
HELP-BUSY-GROUPS)."
  (setf (group-idle-samples group)
        (if (plusp (group-idle group)) (1+ (group-idle-samples group)) 0)
        (group-busy-samples group)
        (if (zerop (group-idle group)) (1+ (group-busy-samples group)) 0)))

(defun note-stillness (pool maker)
  "Count this sample in the still ones in a row: no event begun or ended
since the last sample, every permit holder waiting in epoll_wait (under load,
the sum of the workers' SERVING is not read)."
  (if (all-holders-idle-p pool)
      (let ((served (events-served pool)))
        (setf (maker-still-samples maker)
              (if (= served (maker-last-served maker)) (1+ (maker-still-samples maker)) 0)
              (maker-last-served maker) served))
      (setf (maker-still-samples maker) 0)))

(defun take-sample (pool maker wall)
  "Phase 8: one sample, at WALL (internal real time).  The process's CPU
use over the last samples (NOTE-LOAD); then for each group its counts
\(NOTE-GROUP-SAMPLE) and what its sizing decides (RESIZE-GROUP), unless a
garbage collection ran since the last sample: it stopped every thread but
one, and says nothing about blocked handlers.  Then the busy groups' work
moves to idle ones (HELP-BUSY-GROUPS, with more than one group), and after
+STILL-SAMPLES-BEFORE-REST+ still samples the maker may rest (REST-MAKER-P)."
  (let* ((load (note-load (maker-history maker) (process-cpu-us) wall (maker-cpus maker)))
         (collected (/= (shiftf (maker-last-gc maker) sb-ext:*gc-run-time*)
                        (maker-last-gc maker)))
         (groups (maker-groups maker)))
    (loop for group across groups
          do (note-group-sample group)
             (unless collected
               (resize-group pool group load (maker-share maker) (maker-stat-buffer maker)
                             (maker-found maker) (maker-brief-waits maker)
                             (maker-cpus-idle maker))))
    (when (and (> (length groups) 1) (pool-maker-helps pool))
      (help-busy-groups pool (maker-events maker)))
    (note-stillness pool maker)
    (when (and (>= (maker-still-samples maker) +still-samples-before-rest+)
               (rest-maker-p pool (maker-share maker)))
      (setf (maker-resting maker) t))))

(defun maker-loop (pool)
  "The life of POOL's maker thread, from POOL-START until the pool stops.
One turn, in order:
  1. LOOK-AT-CPUS: once a second, the usable CPUs and a group's share.
  2. READ-IDLE-CPUS: every +IDLE-READ-MS+, whether the CPUs were idle.
  3. WAIT-FOR-SAMPLE: +SAMPLE-MS+, a second while resting.
  4. JOIN-RETIRED: the threads that left.
  5. Exit once STOPPING.
  6. COLLAPSE-WAKE-UPS: one turn for all pending wake-ups.
  7. END-REST-IF-WOKEN: a worker found work while the maker rested.
  8. TAKE-SAMPLE, when one is due (SAMPLE-DUE-P; never while resting).
The maker's state is its MAKER record; its event buffer is freed at exit."
  (let ((maker (make-maker pool)))
    (unwind-protect
         (loop
           (look-at-cpus pool maker)
           (read-idle-cpus maker)
           (wait-for-sample pool maker)
           (join-retired pool)
           (when (pool-stopping pool)
             (return))
           (collapse-wake-ups pool)
           (end-rest-if-woken pool maker)
           (let ((wall (get-internal-real-time)))
             (when (sample-due-p maker wall)
               (take-sample pool maker wall))))
      (free-event-buffer (maker-events maker)))))
