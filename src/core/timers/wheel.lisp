;;;; wheel.lisp -- a hashed timing wheel of connection deadlines.
;;;;
;;;; Connections are scheduled by any thread (the worker that parks one, the
;;;; thread that rejects one) and expired by the housekeeper, which advances
;;;; the wheel one tick (+TICK-MS+) at a time.  Scheduling is O(1): a lock-free
;;;; push of one cons onto a slot; expiry is O(1) per entry.
;;;;
;;;; Deadlines are checked lazily.  Each connection records in WHEEL-TICK the
;;;; tick of the one slot entry that counts for it (or -1 for none).  Moving a
;;;; deadline later costs nothing: when the entry's tick comes, the connection
;;;; is simply scheduled again for its real deadline.  Moving it earlier pushes
;;;; a new entry and sets WHEEL-TICK to it, which turns the old entry stale.
;;;;
;;;; Invariants:
;;;;  - An entry of slot (mod tick +SLOTS+) is (CONNECTION . TICK); it counts only
;;;;    if the connection's WHEEL-TICK is TICK, and stale entries are dropped
;;;;    when their slot is processed.  A connection remembers its counting
;;;;    entry in WHEEL-ENTRY; closing it empties that entry's CAR (see
;;;;    WHEEL-FORGET), so a closed connection is garbage at once instead of
;;;;    when its deadline would have come (under Connection: close load, that
;;;;    would keep every connection of the last 20 s).
;;;;  - A connection whose WHEEL-TICK is not -1 has a counting entry in the
;;;;    slot of that tick, and that tick is no later than the tick of its
;;;;    deadline, so it is looked at no later than its deadline (rounded up to
;;;;    a tick).
;;;;  - Entries are only ever pushed for ticks at least two after CURRENT (the
;;;;    tick the housekeeper is processing), or one after it by the
;;;;    housekeeper itself, so none is missed by a full turn;
;;;;    deadlines beyond the wheel's span go in its last slot and are
;;;;    rescheduled from there.
;;;;  - RESTING is set only by the housekeeper, once it found no entry holding
;;;;    a connection (WHEEL-EMPTY-P), and it then ticks once a second instead
;;;;    of every +TICK-MS+; it is cleared by compare-and-swap, by the
;;;;    housekeeper itself or by the thread whose push ends the rest, which
;;;;    then signals WAKE-FD (WHEEL-SCHEDULE).  The push is a compare-and-
;;;;    swap and the housekeeper looks at the slots again after setting
;;;;    RESTING and a fence, so one of the two sees the other: no deadline
;;;;    waits for a rest to end.

(in-package #:gallop.core)

(defconstant +tick-ms+ 100)
(defconstant +slots+ 512
  "The wheel spans +SLOTS+ * +TICK-MS+ ms (51.2 s).")

(defstruct (wheel (:constructor make-wheel (&optional (current (floor (now-ms) +tick-ms+))))
                  (:copier nil))
  (slots (make-array +slots+ :initial-element nil) :type simple-vector)
  (current 0 :type fixnum)
  ;; While the housekeeper rests (see the invariants), and the eventfd that
  ;; wakes it (in its epoll set), or -1.
  (resting nil)
  (wake-fd -1 :type fixnum))

(defmethod print-object ((wheel wheel) stream)
  (print-unreadable-object (wheel stream :type t :identity t)))

(declaim (inline deadline-tick))
(defun deadline-tick (deadline-ms)
  (declare (type fixnum deadline-ms))
  (values (ceiling deadline-ms +tick-ms+)))

(defun wheel-schedule (wheel connection deadline-ms &key from-advance)
  "Make sure CONNECTION is looked at no later than DEADLINE-MS.  Any thread;
FROM-ADVANCE when called by WHEEL-ADVANCE's FUNCTION (the housekeeper)."
  (declare (type fixnum deadline-ms))
  (let* ((current (wheel-current wheel))
         ;; Another thread may read CURRENT just before the housekeeper moves
         ;; on to CURRENT + 1 and empties that slot: two ticks ahead.  Inside
         ;; WHEEL-ADVANCE, CURRENT is the tick being processed and the next
         ;; is processed after it: one tick ahead, so a deadline in the next
         ;; tick is not looked at a tick late.
         (tick (min (max (deadline-tick deadline-ms) (+ (if from-advance 1 2) current))
                    (+ current (1- +slots+)))))
    (declare (type fixnum current tick))
    (loop
      (let ((old (connection-wheel-tick connection)))
        (declare (type fixnum old))
        (when (and (/= old -1) (<= old tick))
          (return))
        (when (eql old (sb-ext:compare-and-swap (%conn-slot connection wheel-tick) old tick))
          (let ((entry (cons connection tick)))
            (setf (conn-slot connection wheel-entry) entry)
            (sb-ext:atomic-push entry (svref (wheel-slots wheel) (mod tick +slots+))))
          ;; The push fenced (compare-and-swap): a resting housekeeper
          ;; either saw it, or is seen resting here and woken.
          (when (and (wheel-resting wheel)
                     (sb-ext:compare-and-swap (wheel-resting wheel) t nil))
            (signal-eventfd (wheel-wake-fd wheel)))
          (return))))))

(defun wheel-empty-p (wheel)
  "True when no entry of WHEEL holds a connection (entries of closed ones,
emptied by WHEEL-FORGET, wait for their tick to be dropped)."
  (every (lambda (entries) (every (lambda (entry) (null (car entry))) entries))
         (wheel-slots wheel)))

(defun wheel-rest (wheel)
  "Called by the housekeeper: true, with RESTING set, when WHEEL holds no
connection's entry, looked at again after setting RESTING (see the
invariants)."
  (when (wheel-empty-p wheel)
    (setf (wheel-resting wheel) t)
    (sb-thread:barrier (:memory))
    (or (wheel-empty-p wheel)
        (progn (sb-ext:compare-and-swap (wheel-resting wheel) t nil)
               nil))))

(defun wheel-advance (wheel now-ms function)
  "Process every tick up to NOW-MS: call FUNCTION on each connection whose
counting entry comes due.  FUNCTION decides whether the connection expired,
and reschedules it if it did not.  Only the housekeeper calls this."
  (let ((target (floor now-ms +tick-ms+))
        (slots (wheel-slots wheel)))
    (loop while (< (wheel-current wheel) target)
          do (let* ((tick (1+ (wheel-current wheel)))
                    (index (mod tick +slots+))
                    (entries (progn
                               (setf (wheel-current wheel) tick)
                               (loop for head = (svref slots index)
                                     when (eq head (sb-ext:compare-and-swap (svref slots index)
                                                                            head nil))
                                       return head))))
               (dolist (entry entries)
                 (destructuring-bind (connection . entry-tick) entry
                   (when (and connection
                              (= entry-tick tick)
                              (eql tick (sb-ext:compare-and-swap
                                         (%conn-slot connection wheel-tick) tick -1)))
                     (funcall function connection))))))))

(defun wheel-forget (connection)
  "Drop CONNECTION from its wheel entry: it was closed."
  (let ((entry (conn-slot connection wheel-entry)))
    (when entry
      (setf (car entry) nil
            (conn-slot connection wheel-entry) nil))))
