;;;; account.lisp -- the memory account: every octet Gallop holds on behalf
;;;; of a client, in one process-wide count, by kind; and the overload level
;;;; that count and the heap set.
;;;;
;;;; A limit per connection bounds what one client makes the server hold, not
;;;; what ten thousand do together.  So every place that keeps octets for a
;;;; client charges them here, of one of +ACCOUNT-KINDS+, and gives them back
;;;; when it lets go: partial request heads (connection.lisp, the head
;;;; budget), bodies gathered in memory (spool.lisp), WebSocket messages being
;;;; assembled and what inflating them makes (upgrade.lisp), output the
;;;; client has not taken (output-queue.lisp; upgrade.lisp's mailbox),
;;;; and the stacks of threads that switched protocols under their handler.
;;;; The engines' own budgets (HEAD-BUDGET, BODY-BUDGET) stay limits of their
;;;; kinds inside it.  Threads' stacks are mapped outside the heap, whole
;;;; however little of them is touched: they count beside the heap's kinds,
;;;; under a limit of their own (the heap's size unless set), and set no
;;;; overload level, which is about the heap.
;;;;
;;;; The overload level (0 to 3) is what the overload manager
;;;; (loop/overload.lisp) acts on, in a fixed order as it rises: 1, stop
;;;; reading from the largest holders; 2, also refuse new upgrades and new
;;;; large bodies (503 with Retry-After); 3, also close the connections
;;;; holding the most, largest first.  It is the higher of two readings: the
;;;; account against its limit, and the heap in use after the last garbage
;;;; collection against the heap's size, since octets the account does not
;;;; know of (the application's own) fill the same heap (doc/design.md, "One
;;;; memory account").
;;;;
;;;; Counting is one atomic add on a word of its own per kind; the level is a
;;;; few reads and compares, cheap enough for every charge.

(in-package #:gallop.core)

(sb-int:defconstant-eqx +account-kinds+
    #(:heads :bodies :messages :inflate :output :stacks)
  #'equalp
  "The kinds of octets the account counts, in the order of their cells.")

(defconstant +account-stride+ 8
  "Words between two kinds' cells: each on a cache line of its own.")

(declaim (type (simple-array sb-ext:word (*)) *account*))
(sb-ext:defglobal *account*
    (make-array (* +account-stride+ (1+ (length +account-kinds+)))
                :element-type 'sb-ext:word :initial-element 0)
  "The octets counted, of each kind, at (* +ACCOUNT-STRIDE+ (1+ INDEX)).")

(declaim (type fixnum *account-limit* *stacks-limit*))
(sb-ext:defglobal *account-limit* (floor (sb-ext:dynamic-space-size) 2)
  "The octets the heap's kinds (all but :STACKS) together may count: half
the heap unless set (SET-MEMORY-LIMIT).")

(sb-ext:defglobal *stacks-limit* (sb-ext:dynamic-space-size)
  "The octets :STACKS may count: the heap's size unless set.")

(declaim (type fixnum *heap-after-gc*))
(sb-ext:defglobal *heap-after-gc* 0
  "Octets of the heap in use after the last garbage collection.")

(declaim (inline account-index))
(defun account-index (kind)
  (* +account-stride+
     (1+ (ecase kind
           (:heads 0) (:bodies 1) (:messages 2) (:inflate 3) (:output 4) (:stacks 5)))))

(declaim (inline account-add))
(defun account-add (kind octets)
  "Count OCTETS more of KIND (negative: give them back), whatever the limit:
for octets already held.  The count of KIND before."
  (declare (type fixnum octets))
  (let ((i (account-index kind)))
    (if (minusp octets)
        (sb-ext:atomic-decf (aref *account* i) (- octets))
        (sb-ext:atomic-incf (aref *account* i) octets))))

(defun heap-used ()
  "Octets counted of the heap's kinds (all but :STACKS), together."
  (loop for k across +account-kinds+
        unless (eq k :stacks) sum (aref *account* (account-index k))))

(defun account-used (&optional kind)
  "Octets counted of KIND, or of all kinds."
  (if kind
      (aref *account* (account-index kind))
      (loop for k across +account-kinds+ sum (aref *account* (account-index k)))))

(defun account-limit (&optional kind)
  "Octets the heap's kinds together may count; with KIND :STACKS, the
stacks' own limit."
  (if (eq kind :stacks) *stacks-limit* *account-limit*))

(defun set-memory-limit (octets &key (stacks nil stacks-p))
  "Set the limit of what the heap's kinds may count to OCTETS (NIL: half
the heap), and with STACKS that of the switched threads' stacks (NIL: the
heap's size).  Process-wide: every server of the process shares the account."
  (when stacks-p
    (setf *stacks-limit* (if stacks (max 1 stacks) (sb-ext:dynamic-space-size))))
  (setf *account-limit* (if octets
                            (max 1 (min octets (sb-ext:dynamic-space-size)))
                            (floor (sb-ext:dynamic-space-size) 2))))

(defun account-charge (kind octets)
  "Count OCTETS more of KIND when its limit allows (the heap's kinds
together under theirs, :STACKS under its own): true, or NIL (nothing
counted)."
  (declare (type fixnum octets))
  (account-add kind octets)
  (if (if (eq kind :stacks)
          (> (account-used :stacks) *stacks-limit*)
          (> (heap-used) *account-limit*))
      (progn (account-add kind (- octets)) nil)
      t))

;;; The overload level.  Its thresholds, in percent of the account's limit
;;; and of the heap's size (after a collection): levels 1, 2 and 3 begin at
;;; the first, second and third of each list.  Below the first, level 0.

(sb-int:defconstant-eqx +account-thresholds+ #(50 70 85) #'equalp
  "Percent of the account's limit at which levels 1, 2 and 3 begin.")

(sb-int:defconstant-eqx +heap-thresholds+ #(60 70 80) #'equalp
  "Percent of the heap in use after a collection at which levels 1, 2 and 3
begin.")

(defun level-of (used limit thresholds)
  (declare (type fixnum used limit) (type simple-vector thresholds))
  (let ((level 0))
    (dotimes (i 3 level)
      (when (>= (* 100 used) (* (the fixnum (svref thresholds i)) limit))
        (setf level (1+ i))))))

(defconstant +heap-reading-share+ 20
  "The heap's reading sets the level only while the account holds at least
1/+HEAP-READING-SHARE+ of its limit: below, what fills the heap is not the
clients', and shedding them would not help.")

(defun overload-level ()
  "0 when memory is plenty; 1, 2 or 3 as the account or the heap after the
last collection passes its thresholds (see above)."
  (let ((used (heap-used)))
    (max (level-of used *account-limit* +account-thresholds+)
         (if (>= (* +heap-reading-share+ used) *account-limit*)
             (level-of *heap-after-gc* (sb-ext:dynamic-space-size) +heap-thresholds+)
             0))))

(defun account-level-bound (level)
  "Octets the account may count and stay below LEVEL (1 to 3)."
  (floor (* (svref +account-thresholds+ (1- level)) *account-limit*) 100))

(defun note-heap-after-gc ()
  (setf *heap-after-gc* (sb-kernel:dynamic-usage)))

(pushnew 'note-heap-after-gc sb-ext:*after-gc-hooks*)
