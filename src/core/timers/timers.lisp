;;;; timers.lisp -- application timers: a thunk run on a pool worker at a
;;;; given time (GALLOP:AFTER), with no thread per pending timer.
;;;;
;;;; A delayed answer (a long poll, an event that comes later, cl-async's
;;;; "answer in 5 s") should cost memory, not a thread.  A TIMERS holds every
;;;; pending timer of one engine in a binary min-heap ordered by deadline, and
;;;; a timerfd armed for the earliest one, registered in the housekeeper's
;;;; epoll set: the housekeeper wakes when it expires (not at its 100 ms
;;;; tick: the timerfd has the kernel's timer resolution), takes every timer
;;;; that came due off the heap and queues its thunk on the pool's ready
;;;; queue, where the next free worker runs it (pool/groups.lisp) -- never the
;;;; housekeeper, which must go on accepting and expiring.  A thunk that
;;;; blocks blocks its worker, which the pool sees as any blocked handler.
;;;;
;;;; Cancelling marks the timer (its thunk is dropped at once, so what it
;;;; holds is garbage); the heap entry goes when its deadline comes.
;;;;
;;;; Invariants:
;;;;  - HEAP[0, COUNT) is a binary min-heap on TIMER-DEADLINE (µs of the
;;;;    monotonic clock); every element is a TIMER not yet taken off it.  Only
;;;;    under LOCK.
;;;;  - PENDING counts timers scheduled and neither run nor cancelled.
;;;;  - The timerfd is armed for HEAP[0]'s deadline whenever COUNT > 0 (the
;;;;    one who changes the minimum re-arms it, under LOCK); a spurious
;;;;    expiry only makes the housekeeper look and find nothing due.
;;;;  - A timer's THUNK is NIL once it ran, was queued to run, or was
;;;;    cancelled: it runs at most once.

(in-package #:gallop.core)

(defstruct (timer (:constructor make-timer (deadline thunk timers)) (:copier nil))
  "One pending call: THUNK, run on a pool worker at DEADLINE (µs of the
monotonic clock), kept by TIMERS.  What GALLOP:AFTER returns, for
GALLOP:CANCEL-TIMER."
  (deadline 0 :type fixnum)
  (thunk nil :type (or null function))
  (timers nil))

(defmethod print-object ((timer timer) stream)
  (print-unreadable-object (timer stream :type t :identity t)))

(defstruct (timers (:constructor %make-timers) (:copier nil))
  (lock (sb-thread:make-mutex :name "gallop timers"))
  (heap (make-array 64) :type simple-vector)
  (count 0 :type fixnum)
  (pending 0 :type sb-ext:word)
  (fd -1 :type fixnum))

(defmethod print-object ((timers timers) stream)
  (print-unreadable-object (timers stream :type t :identity t)))

(defun make-timers ()
  "Timers with their timerfd (CLOCK_MONOTONIC, non-blocking), not armed."
  (%make-timers :fd (make-timerfd)))

(defun free-timers (timers)
  "Drop every pending timer and close the timerfd."
  (sb-thread:with-mutex ((timers-lock timers))
    (loop for i below (timers-count timers)
          do (setf (timer-thunk (svref (timers-heap timers) i)) nil))
    (fill (timers-heap timers) 0)
    (setf (timers-count timers) 0
          (timers-pending timers) 0))
  (when (>= (timers-fd timers) 0)
    (close-fd (shiftf (timers-fd timers) -1))))

;;; The heap

(defun heap-up (heap i)
  (declare (type simple-vector heap) (type fixnum i))
  (let ((timer (svref heap i)))
    (loop while (plusp i)
          do (let ((parent (floor (1- i) 2)))
               (if (< (timer-deadline timer) (timer-deadline (svref heap parent)))
                   (setf (svref heap i) (svref heap parent)
                         i parent)
                   (return))))
    (setf (svref heap i) timer)))

(defun heap-down (heap count i)
  (declare (type simple-vector heap) (type fixnum count i))
  (let ((timer (svref heap i)))
    (loop
      (let* ((left (1+ (* 2 i)))
             (right (1+ left))
             (child (cond ((>= left count) (return))
                          ((and (< right count)
                                (< (timer-deadline (svref heap right))
                                   (timer-deadline (svref heap left))))
                           right)
                          (t left))))
        (if (< (timer-deadline (svref heap child)) (timer-deadline timer))
            (setf (svref heap i) (svref heap child)
                  i child)
            (return))))
    (setf (svref heap i) timer)))

(defun heap-pop (timers)
  "Take the earliest timer off the heap (COUNT > 0, under LOCK)."
  (let* ((heap (timers-heap timers))
         (top (svref heap 0))
         (count (1- (timers-count timers))))
    (setf (svref heap 0) (svref heap count)
          (svref heap count) 0
          (timers-count timers) count)
    (when (plusp count)
      (heap-down heap count 0))
    top))

(defun arm (timers)
  "Arm the timerfd for the earliest deadline (under LOCK)."
  (when (plusp (timers-count timers))
    (set-timerfd (timers-fd timers) (timer-deadline (svref (timers-heap timers) 0)))))

;;; Scheduling, cancelling, running

(defun timers-schedule (timers seconds thunk)
  "Run THUNK on a pool worker once SECONDS (a real number, at least 0) have
passed; returns the TIMER."
  (check-type seconds (real 0))
  (check-type thunk function)
  (let ((timer (make-timer (+ (now-us) (round (* seconds 1000000))) thunk timers)))
    (sb-thread:with-mutex ((timers-lock timers))
      (when (< (timers-fd timers) 0)
        (error "The server of this timer is stopped."))
      (let ((count (timers-count timers)))
        (when (= count (length (timers-heap timers)))
          (setf (timers-heap timers)
                (replace (make-array (* 2 count) :initial-element 0) (timers-heap timers))))
        (setf (svref (timers-heap timers) count) timer
              (timers-count timers) (1+ count))
        (heap-up (timers-heap timers) count)
        (incf (timers-pending timers))
        (when (eq timer (svref (timers-heap timers) 0))
          (arm timers))))
    timer))

(defun cancel-timer (timer)
  "Cancel TIMER if it has not run: true if it was pending, NIL if it ran (or
is about to, on a worker) or was cancelled already."
  (sb-thread:with-mutex ((timers-lock (timer-timers timer)))
    (when (timer-thunk timer)
      (setf (timer-thunk timer) nil)
      (decf (timers-pending (timer-timers timer)))
      t)))

(defun schedule-timer (pool seconds thunk)
  "GALLOP:AFTER on POOL, a running engine's pool: run THUNK on one of its
workers once SECONDS have passed.  Returns the TIMER."
  (let ((timers (pool-timers pool)))
    (unless timers
      (error "The server of this pool is not running."))
    (timers-schedule timers seconds thunk)))

(defun timers-pending-count (timers)
  (if timers (timers-pending timers) 0))

(defun timers-fire (timers run)
  "Called by the housekeeper when the timerfd is readable: call RUN (a
function of one thunk, which queues it for a worker) for every timer that
came due, and arm the timerfd for the next."
  (read-timerfd (timers-fd timers))
  (let ((due '()))
    (sb-thread:with-mutex ((timers-lock timers))
      (let ((now (now-us)))
        (loop while (and (plusp (timers-count timers))
                         (<= (timer-deadline (svref (timers-heap timers) 0)) now))
              do (let* ((timer (heap-pop timers))
                        (thunk (timer-thunk timer)))
                   (when thunk
                     (setf (timer-thunk timer) nil)
                     (decf (timers-pending timers))
                     (push thunk due)))))
      (arm timers))
    ;; Earliest first.
    (dolist (thunk (nreverse due))
      (funcall run thunk))))
