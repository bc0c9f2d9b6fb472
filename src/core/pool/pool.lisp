;;;; pool.lisp -- the elastic pool of worker threads: its groups, its workers'
;;;; records and the pool object, which every other file of pool/ reads.
;;;;
;;;; GROUPS.  *GROUP-COUNT* groups (by default one per usable CPU, at most
;;;; MAX-THREADS), each with its own epoll set, READY queue, NUDGE eventfd,
;;;; run permits and workers.  A connection joins one group's set when it is
;;;; accepted (POOL-NEXT-GROUP, in turn) and stays there.  Groups share only
;;;; the wake eventfd (signalled at stop) and the maker thread: workers that
;;;; share a set contend on its kernel lock (doc/design.md, "An epoll set per
;;;; CPU").
;;;;
;;;; The pool's files, each built on those before it: sizing.lisp (the
;;;; sizing policy, a pure function), this file (the objects), groups.lisp
;;;; (what waits in a group: its READY queue, nudges, stealing), worker.lisp
;;;; (run permits and the worker loop), maker.lisp (the maker thread:
;;;; samples, growth and shrink, rest), start.lisp (starting and stopping a
;;;; pool).
;;;;
;;;; Invariants:
;;;;  - THREAD-COUNT = (length THREADS) = the sum of the groups' THREAD-COUNTs
;;;;    <= MAX-THREADS, under LOCK; a worker that stepped out (POOL-STEP-OUT:
;;;;    held by one long-lived connection) is in OUTSIDE instead, uncounted.
;;;;    A leaving worker moves itself to RETIRED, which the maker or
;;;;    POOL-STOP joins: every thread started is joined.
;;;;  - A group's slots change only as its docstring says: IDLE and HOLDERS
;;;;    atomically, by its workers; the others by the maker, or under LOCK.
;;;;    A WORKER record is written by its own worker only.

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
bench/server.lisp sets it from GALLOP_EPOLL_SETS, so that an A/B run
\(bench/checkouts-ab.sh, ENV_A/ENV_B) can compare the two (doc/design.md,
\"An epoll set per CPU\").")

(defvar *maker-helps* t
  "True: the maker moves the waiting events of a group whose workers are all
busy to an idle group (STEALING in groups.lisp, HELP-BUSY-GROUPS).  Read
by POOL-START.  Only the tests turn it off, to see the workers' own
stealing alone.")

(defstruct (group (:constructor make-group ()) (:copier nil))
  "One epoll set, with its queue, nudge eventfd, run permits and workers
\(GROUPS in the header).  IDLE and HOLDERS change atomically, by its
workers; the rest after POOL-START is the maker's, or changes under the
pool's LOCK."
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
  ;; True while the maker rests (RESTING in maker.lisp).  Set only by the
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
