;;;; groups.lisp -- what waits in a group for its workers: the READY queue,
;;;; the nudges that wake a waiting worker for it, and stealing between
;;;; groups.
;;;;
;;;; READY.  A group's workers wait in its epoll set as leaders/followers
;;;; (worker.lisp); a lone waiter takes up to +BATCH+ events and queues all
;;;; but the first on READY (doc/design.md, "One event per waiter").  READY
;;;; also takes pipelined turns (GROUP-REQUEUE: a list) and due timers
;;;; (POOL-SUBMIT: a function); an event waits there as ENCODE-EVENT encodes
;;;; it (a fixnum).  Workers empty READY before they wait; whoever queues
;;;; while others wait nudges one, through the group's edge-triggered NUDGE
;;;; eventfd.
;;;;
;;;; STEALING.  A worker about to wait takes work waiting in another group's
;;;; queue or set (STEAL-ONE), and the maker moves the work of a group busy
;;;; two samples in a row to an idle group (HELP-BUSY-GROUPS): no worker
;;;; sleeps while another set has work, and a group whose handlers all block
;;;; delays its connections by about 10 ms, not for as long as they block
;;;; (doc/design.md, "Stealing between groups").
;;;;
;;;; Invariants:
;;;;  - Every event taken from a set is served once.  A connection with both a
;;;;    queued turn and a new event is found busy (:DIRTY) or drained by the
;;;;    second, which parks it again.
;;;;  - A queuer reads IDLE after its enqueue, a worker counts itself idle
;;;;    before its last look at the queue (both atomic): no queued event
;;;;    waits for want of a nudge while a worker that could take it sleeps.
;;;;  - The wake eventfd and a group's nudge, taken from a set by a thread
;;;;    that is not one of its workers, are left or given back to them
;;;;    (TAKE-FROM-OTHER-SET).

(in-package #:gallop.core)

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

(defun group-requeue (group data)
  "Queue DATA for a worker of GROUP as if epoll had just reported it readable,
behind the events already queued (a connection that has served its turn, see
YIELD-TURN).  The caller has given the connection up."
  (sb-concurrency:enqueue (list data) (group-ready group)) ; a list: see TAKE-REQUEUED
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

