;;;; account.lisp -- SHIM for branch wt-broadcast, replaced by main's
;;;; account.lisp (the memory account of issue 63) when main is merged.
;;;; Only what the broadcast work calls: a process-wide count of octets by
;;;; kind, its limit, and the overload level read from them and the heap.

(in-package #:gallop.core)

(sb-int:defconstant-eqx +account-kinds+
    #(:heads :bodies :messages :inflate :output :stacks)
  #'equalp
  "The kinds of octets the account counts.")

(declaim (type (simple-array sb-ext:word (*)) *account*))
(sb-ext:defglobal *account*
    (make-array (* 8 (1+ (length +account-kinds+))) :element-type 'sb-ext:word
                                                     :initial-element 0))

(declaim (type fixnum *account-limit*))
(sb-ext:defglobal *account-limit* (floor (sb-ext:dynamic-space-size) 2))

(declaim (inline account-index))
(defun account-index (kind)
  (* 8 (1+ (ecase kind
             (:heads 0) (:bodies 1) (:messages 2) (:inflate 3) (:output 4) (:stacks 5)))))

(declaim (inline account-add))
(defun account-add (kind octets)
  "Count OCTETS more of KIND (negative: give them back), whatever the limit."
  (declare (type fixnum octets))
  (let ((i (account-index kind)))
    (if (minusp octets)
        (sb-ext:atomic-decf (aref *account* i) (- octets))
        (sb-ext:atomic-incf (aref *account* i) octets))))

(defun account-used (&optional kind)
  "Octets counted of KIND, or of all kinds."
  (if kind
      (aref *account* (account-index kind))
      (loop for k across +account-kinds+ sum (aref *account* (account-index k)))))

(defun account-limit () *account-limit*)

(defun set-memory-limit (octets)
  (setf *account-limit* (or octets (floor (sb-ext:dynamic-space-size) 2))))

(defun account-charge (kind octets)
  "Count OCTETS more of KIND when the account stays under its limit: true,
or NIL (nothing counted)."
  (declare (type fixnum octets))
  (account-add kind octets)
  (if (> (account-used) *account-limit*)
      (progn (account-add kind (- octets)) nil)
      t))

(declaim (type fixnum *heap-after-gc*))
(sb-ext:defglobal *heap-after-gc* 0)

(defun level-of (used limit thresholds)
  (let ((level 0))
    (loop for percent in thresholds for i from 1
          when (>= (* 100 used) (* percent limit)) do (setf level i))
    level))

(defun overload-level ()
  "0 when memory is plenty; 1, 2 or 3 as the account passes 50, 70 and 85%
of its limit, or the heap in use after the last collection 60, 70 and 80%
of the heap."
  (max (level-of (account-used) *account-limit* '(50 70 85))
       (level-of *heap-after-gc* (sb-ext:dynamic-space-size) '(60 70 80))))

(defun note-heap-after-gc ()
  (setf *heap-after-gc* (sb-kernel:dynamic-usage)))

(pushnew 'note-heap-after-gc sb-ext:*after-gc-hooks*)
