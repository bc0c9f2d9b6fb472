;;;; shed.lisp -- the overload manager's last action (overload.lisp, level 3):
;;;; the connections holding the most are closed, largest first, and its
;;;; pass, made by one housekeeper at a time over every engine of the process.

(in-package #:gallop.core)

;;; Level 3: shedding.

(defun shed-connection (c)
  "Close C, one of the largest holders, from the manager's thread, as its
state allows: an upgraded one as its layer says (its ON-SHED) or at once;
a parked one at once (503 when its body was arriving); one a worker owns is
marked, and fails at its next queued write (SEND-ALL).  True when done or
marked."
  (let ((u (conn-slot c upgrade)))
    (cond ((and u (not (upgrade-ended u)))
           ;; Marked: going (SHED-LARGEST counts what it holds as given back).
           (setf (conn-slot c shed) t)
           (close-upgraded-as-layer-says c (upgrade-on-shed u) "for the overload manager")
           t)
          ((eq (connection-state c) :parked)
           (when (eq :parked (sb-ext:compare-and-swap (%conn-slot c state) :parked :active))
             (cond ((request-gathering (connection-request c))
                    (reject-connection c (response-503 (connection-engine c))))
                   (t
                    (when (conn-slot c unsent)
                      (set-reset-on-close (connection-fd c)))
                    (close-connection c)))
             t))
          ((member (connection-state c) '(:active :dirty))
           ;; Its owner's next queued write fails; PARK clears the mark of a
           ;; connection that needed none until its request ended.
           (setf (conn-slot c shed) t))
          (t nil))))

(defun shed-largest (bound)
  "Close the connections of every running engine holding the most, largest
first, until the account is at most BOUND octets, by what they hold.  Those
shed already and not closed yet (a WebSocket sending its close frame) count
as given back.  Returns how many were closed or marked."
  (let ((holders '())
        (going 0))
    (dolist (engine *engines*)
      (when (engine-running-p engine)
        (loop for c across (engine-table engine)
              when c
                do (let ((held (connection-held-octets c)))
                     (cond ((conn-slot c shed) (incf going held))
                           ((>= held +shed-floor-octets+) (push (cons held c) holders)))))))
    (let ((over (- (heap-used) going bound))
          (count 0))
      (dolist (entry (sort holders #'> :key #'car) count)
        (when (<= over 0) (return count))
        (when (shed-connection (cdr entry))
          (incf count)
          (sb-ext:atomic-incf (aref *overload-counts* 2))
          (decf over (car entry)))))))

(sb-ext:defglobal *last-pass-ms* 0)
(sb-ext:defglobal *pass-lock* (sb-thread:make-mutex :name "gallop overload manager"))
(sb-ext:defglobal *shed-heap-epoch* -1
  "The garbage collection after which the last shedding for the heap's sake
was made: the heap's level is read again only after the next one.")

(defun overload-pass (now)
  "The manager's pass, from a housekeeper's tick: at level 0, give the
paused connections back to the workers; at level 3, shed the largest
holders.  At most one pass every +OVERLOAD-PASS-MS+, in one thread at a time."
  (when (and (>= (- now *last-pass-ms*) +overload-pass-ms+)
             (sb-thread:grab-mutex *pass-lock* :waitp nil))
    (unwind-protect
         (progn
           (setf *last-pass-ms* now)
           (let ((level (overload-level)))
             (cond ((zerop level)
                    (when *paused* (resume-paused)))
                   ((= level 3)
                    (if (>= (heap-used) (account-level-bound 3))
                        (shed-largest (account-level-bound 2))
                        ;; The heap is full, not the account: shed what the
                        ;; largest hold once per collection, since the heap's
                        ;; reading changes only after the next one.
                        (let ((epoch sb-kernel::*gc-epoch*))
                          (unless (eq epoch *shed-heap-epoch*)
                            (setf *shed-heap-epoch* epoch)
                            (shed-largest (- (heap-used)
                                             (max (* 4 (large-holder-octets))
                                                  (floor (heap-used) 4)))))))))))
      (sb-thread:release-mutex *pass-lock*))))
