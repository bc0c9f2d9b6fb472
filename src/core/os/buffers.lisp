;;;; buffers.lisp -- a shared free list of octet buffers.
;;;;
;;;; A connection holds input and output buffers only while a worker serves it
;;;; or while a partial request head waits in it; an idle keep-alive
;;;; connection holds none.  Buffers go back to this free list instead of to
;;;; the GC, so steady traffic allocates no buffers at all.
;;;;
;;;; Invariants: FREE[0, COUNT) holds buffers of length +BUFFER-SIZE+ that
;;;; nobody owns; FREE[COUNT, end) holds NIL.  At most +MAX-FREE-BUFFERS+ are
;;;; kept: the rest go to the GC, so a burst does not pin memory forever.
;;;;
;;;; A worker serving keep-alive requests takes and gives back two buffers
;;;; per request, so each worker thread also keeps up to
;;;; +THREAD-CACHED-BUFFERS+ in *THREAD-BUFFERS* (bound per worker): those
;;;; cost no lock.  Other threads see the global value, NIL.

(in-package #:gallop.core)

(defconstant +buffer-size+ 8192
  "Size of a pooled buffer: a typical request head fits in one.")

(defconstant +max-free-buffers+ 1024)

(defstruct (buffer-pool (:constructor make-buffer-pool ()) (:copier nil))
  (lock (sb-thread:make-mutex :name "gallop buffer pool"))
  (free (make-array +max-free-buffers+) :type simple-vector)
  (count 0 :type fixnum)
  (dropped 0 :type sb-ext:word)) ; octets of grown buffers left to the GC, see NOTE-DROPPED

(defmethod print-object ((buffers buffer-pool) stream)
  (print-unreadable-object (buffers stream :type t :identity t)))

(sb-ext:define-load-time-global *buffer-pool* (make-buffer-pool))

(defconstant +thread-cached-buffers+ 4)

(defvar *thread-buffers* nil
  "In a worker thread: a cons whose car is a list of free buffers this thread
keeps, and whose cdr is their count.  NIL elsewhere.")

(defmacro with-thread-buffers (&body body)
  "Run BODY (a worker's loop) with a buffer cache of its own."
  `(let ((*thread-buffers* (cons '() 0)))
     ,@body))

(defun acquire-buffer ()
  "An octet buffer of +BUFFER-SIZE+ bytes, from the free list when it can."
  (let ((pool *buffer-pool*)
        (cache *thread-buffers*))
    (or (and cache (plusp (the fixnum (cdr cache)))
             (progn (decf (the fixnum (cdr cache)))
                    (pop (car cache))))
        (sb-thread:with-mutex ((buffer-pool-lock pool))
          (let ((n (buffer-pool-count pool)))
            (when (plusp n)
              (setf (buffer-pool-count pool) (1- n))
              (shiftf (svref (buffer-pool-free pool) (1- n)) nil))))
        (make-array +buffer-size+ :element-type '(unsigned-byte 8)))))

(defun note-dropped (octets)
  "A buffer of OCTETS grown for a long head was left to the GC.  Such buffers
live long enough (a head arriving over many reads) to be promoted to older
generations, which SBCL collects rarely; under a stream of long heads that
garbage can fill the heap while the live heads stay within the head budget.
So once a quarter of the heap's worth of them was dropped, collect every
generation."
  (declare (type fixnum octets))
  (let* ((pool *buffer-pool*)
         (dropped (+ octets (sb-ext:atomic-incf (buffer-pool-dropped pool) octets))))
    (when (and (>= dropped (floor (sb-ext:dynamic-space-size) 4))
               ;; One thread collects, the one that reset the count.
               (= dropped (sb-ext:compare-and-swap (buffer-pool-dropped pool) dropped 0)))
      (sb-ext:gc :full t))))

(defun release-buffer (buffer)
  "Give BUFFER back.  Buffers of another size (grown for a large head) are
left to the GC (see NOTE-DROPPED)."
  (declare (type octets buffer))
  (if (/= (length buffer) +buffer-size+)
      (note-dropped (length buffer))
      (let ((pool *buffer-pool*)
            (cache *thread-buffers*))
        (when (and cache (< (the fixnum (cdr cache)) +thread-cached-buffers+))
          (push buffer (car cache))
          (incf (the fixnum (cdr cache)))
          (return-from release-buffer nil))
        (sb-thread:with-mutex ((buffer-pool-lock pool))
          (let ((n (buffer-pool-count pool)))
            (when (< n +max-free-buffers+)
              (setf (svref (buffer-pool-free pool) n) buffer
                    (buffer-pool-count pool) (1+ n)))))))
  nil)

;;; The octets HTTP framing is made of, by name.

(defconstant +tab+ 9)
(defconstant +lf+ 10)
(defconstant +cr+ 13)
(defconstant +sp+ 32)
(defconstant +dquote+ 34)
(defconstant +percent+ 37)
(defconstant +comma+ 44)
(defconstant +colon+ 58)
(defconstant +semicolon+ 59)
(defconstant +equals+ 61)
(defconstant +question+ 63)
(defconstant +backslash+ 92)

(sb-int:defconstant-eqx +crlf-octets+
    (make-array 2 :element-type '(unsigned-byte 8) :initial-contents (list +cr+ +lf+))
  #'equalp
  "CR LF, the end of every line of an HTTP head and of a chunk's framing: the
one vector every writer sends it from.")

;;; Scanning octets: typed loops, so no generic sequence function runs on the
;;; hot path.

(declaim (inline line-end))
(defun line-end (buffer start end)
  "Index of the LF ending the line that starts at START, before END."
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (loop for i of-type fixnum from start below end
        when (= (aref buffer i) +lf+) return i))

(declaim (inline octet-position))
(defun octet-position (octet buffer start end)
  "Index of the first OCTET in BUFFER[START,END), or NIL."
  (declare (type octets buffer) (type fixnum start end) (type (unsigned-byte 8) octet)
           (optimize speed))
  (loop for i of-type fixnum from start below end
        when (= (aref buffer i) octet) return i))


;;; Classes of octets (RFC 9110, 5.6.2; RFC 9112), for the head and the
;;; chunk framing alike.

(declaim (inline tchar-p vchar-p digit-value hex-value))

(deftype octet-set () '(simple-bit-vector 256))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defun make-octet-set (predicate)
    (let ((set (make-array 256 :element-type 'bit :initial-element 0)))
      (dotimes (b 256 set)
        (when (funcall predicate b) (setf (sbit set b) 1))))))

(sb-int:defconstant-eqx +tchars+
    (make-octet-set (lambda (b)
                      (or (<= 97 b 122) (<= 65 b 90) (<= 48 b 57)
                          (member b '(33 35 36 37 38 39 42 43 45 46 94 95 96 124 126)))))
  #'equal
  "The token characters (RFC 9110, 5.6.2), as a bit per octet: one memory
read per octet instead of a chain of comparisons.")

(defun tchar-p (b)
  "A token character (RFC 9110, 5.6.2)."
  (declare (type (unsigned-byte 8) b))
  (= 1 (sbit (the octet-set (load-time-value +tchars+ t)) b)))

(defun vchar-p (b)
  "A byte allowed in a field value: visible ASCII, obs-text, space or tab."
  (declare (type (unsigned-byte 8) b))
  (or (<= 32 b 126) (= b 9) (>= b 128)))

(defun digit-value (b)
  (declare (type (unsigned-byte 8) b))
  (and (<= 48 b 57) (- b 48)))

(defun hex-value (b)
  (declare (type (unsigned-byte 8) b))
  (cond ((<= 48 b 57) (- b 48))
        ((<= 97 b 102) (- b 87))
        ((<= 65 b 70) (- b 55))))

;;; Matching octets against names known at compile time.  The names become
;;; immediate operands in the code: nothing but the buffer is read, so a
;;; request touches no table of names (each a separate heap object that,
;;; with the kernel's TCP work in between, is out of the cache again by the
;;; next request).

(defmacro octets-match-p (buffer start end name &key ignore-case)
  "Are the octets BUFFER[START,END) the ASCII string NAME (a literal; lower
case when IGNORE-CASE, which then also accepts upper-case octets)?"
  (check-type name string)
  (check-type ignore-case boolean)
  (when ignore-case
    (assert (string= name (string-downcase name)) () "~S is not in lower case." name))
  (let ((b (gensym "BUFFER")) (s (gensym "START")) (e (gensym "END")))
    `(let ((,b ,buffer) (,s ,start) (,e ,end))
       (declare (type octets ,b) (type fixnum ,s ,e) (ignorable ,b))
       (and (= (- ,e ,s) ,(length name))
            ,@(loop for i from 0 for ch across name
                    collect (let ((octet `(aref ,b (+ ,s ,i))))
                              (if (and ignore-case (alpha-char-p ch))
                                  ;; ASCII letters differ from their upper case in bit 5 only.
                                  `(= (logior ,octet 32) ,(char-code ch))
                                  `(= ,octet ,(char-code ch)))))))))

(defmacro octets-case ((buffer start end &key ignore-case) &body clauses)
  "Evaluate the body of the first clause (NAME form...) whose literal NAME the
octets BUFFER[START,END) match (see OCTETS-MATCH-P); a last clause (T
form...) is the default (else NIL).  Dispatches on the length first.
IGNORE-CASE is read when the macro expands: T or NIL, not a variable."
  (check-type ignore-case boolean)
  (let* ((b (gensym "BUFFER")) (s (gensym "START")) (e (gensym "END"))
         (match (gensym "MATCH"))
         (default-clause (assoc t clauses))
         (named (remove default-clause clauses))
         (lengths (remove-duplicates (mapcar (lambda (clause) (length (car clause))) named))))
    (when (and default-clause (not (eq default-clause (car (last clauses)))))
      (error "OCTETS-CASE: the T clause must be the last."))
    (dolist (clause named)
      (check-type (car clause) string))
    `(let ((,b ,buffer) (,s ,start) (,e ,end))
       (declare (type octets ,b) (type fixnum ,s ,e))
       (block ,match
         (case (- ,e ,s)
           ,@(loop for n in lengths
                   collect `(,n (cond ,@(loop for (name . body) in named
                                              when (= (length name) n)
                                                collect `((octets-match-p ,b ,s ,e ,name
                                                                          :ignore-case ,ignore-case)
                                                          (return-from ,match
                                                            (progn ,@(or body '(nil))))))))))
         ;; No name matched: the default, written once.
         ,@(or (cdr default-clause) '(nil))))))
