;;;; spool.lisp -- a request body the engine reads in epoll before its
;;;; handler runs, held for the handler: in memory, or in a temporary file.
;;;;
;;;; A client chooses how fast it sends its body; a worker waiting for it
;;;; would be a worker held by the client.  So the engine reads bodies as
;;;; they arrive, between epoll events, into a SPOOL, and runs the handler
;;;; once the whole body is here (serve.lisp, GATHER-BODY); the handler reads
;;;; the spool and never waits for the client.  This is nginx's request
;;;; buffering (client_body_buffer_size, client_body_temp_path), with two
;;;; budgets nginx lacks (doc/design.md, "A slow body holds no worker"):
;;;;  - memory: a body is kept in memory up to the engine's BODY-BUFFER-BYTES,
;;;;    and all bodies in memory together under BODY-BUDGET (ENGINE-BODY-BYTES
;;;;    counts them).  A body past either goes to a temporary file, all of it;
;;;;  - disk: the temporary files together stay under DISK-BUDGET
;;;;    (ENGINE-DISK-BYTES); a body that would go past it gets 503.
;;;; A temporary file is unlinked as soon as it is made: it has no name, and
;;;; the kernel frees it when its fd closes, however the process ends.
;;;;
;;;; Memory is held in the engine's pooled buffers (buffers.lisp), so that
;;;; bodies leave no garbage behind: the buffer of index K holds octets
;;;; K * +BUFFER-SIZE+ to (K + 1) * +BUFFER-SIZE+ of the body.
;;;;
;;;; Invariants: while FD is -1 the buffers in MEMORY hold FILL octets, and
;;;; CHARGED is +BUFFER-SIZE+ times their count; once FD is open, the file
;;;; holds all FILL octets, MEMORY is NIL, CHARGED is 0 and DISK is FILL.
;;;; READ-POS <= FILL.

(in-package #:gallop.core)

(defconstant +disk-error-log-ms+ 60000
  "The least time between two log lines about temporary files that failed.")

(defstruct (spool (:constructor make-spool ()) (:copier nil) (:predicate nil))
  "A request body held for its handler (see the file's header)."
  (memory nil :type (or null simple-vector))
  (fill 0 :type fixnum)
  (fd -1 :type fixnum)
  (charged 0 :type fixnum)
  (disk 0 :type fixnum)
  (read-pos 0 :type fixnum)
  (window nil :type (or null octets))
  (window-start 0 :type fixnum)
  (window-end 0 :type fixnum))

(defmethod print-object ((spool spool) stream)
  (print-unreadable-object (spool stream :type t :identity t)
    (format stream "~D octets~:[~; in a file~]" (spool-fill spool) (>= (spool-fd spool) 0))))

(defun temp-directory-name (directory)
  "DIRECTORY (a pathname designator, or NIL: $TMPDIR, else /tmp) as a
namestring ending in /."
  (let ((name (if directory
                  (namestring directory)
                  (let ((env (sb-ext:posix-getenv "TMPDIR")))
                    (if (and env (plusp (length env))) env "/tmp")))))
    (coerce (if (char= #\/ (char name (1- (length name))))
                name
                (concatenate 'string name "/"))
            'simple-string)))

(defun charge-budget (engine place-incf budget delta)
  "Count DELTA octets more against a budget of ENGINE, kept by PLACE-INCF
\(BODY-BYTES-INCF or DISK-BYTES-INCF): NIL when that would exceed BUDGET
\(nothing is counted then)."
  (declare (type function place-incf) (type fixnum budget delta))
  (if (> (+ delta (the fixnum (funcall place-incf engine delta))) budget)
      (progn (funcall place-incf engine (- delta)) nil)
      t))

(macrolet ((define-budget-incf (name counter)
             `(defun ,name (engine delta)
                ,(format nil "Add DELTA (maybe negative) to ENGINE's ~A; the value before."
                         counter)
                (declare (type fixnum delta))
                (if (minusp delta)
                    (sb-ext:atomic-decf (,counter engine) (- delta))
                    (sb-ext:atomic-incf (,counter engine) delta)))))
  (define-budget-incf body-bytes-incf engine-body-bytes)
  (define-budget-incf disk-bytes-incf engine-disk-bytes))

(defun spool-failed (engine format-control &rest args)
  "A temporary file could not be made or written: log it, at most once a
minute (every body would fail the same way)."
  (let ((now (now-ms))
        (last (engine-disk-error-ms engine)))
    (when (and (or (zerop last) (>= (- now last) +disk-error-log-ms+))
               (eql last (sb-ext:compare-and-swap (engine-disk-error-ms engine) last now)))
      (apply #'log-engine-error engine format-control args))))

(defun spool-to-disk (engine spool)
  "Move SPOOL's octets from memory to a new temporary file.  NIL when no file
could be made or written."
  (multiple-value-bind (fd errno) (open-temporary-file (engine-temp-directory engine))
    (when (minusp fd)
      (spool-failed engine "No temporary file for a request body in ~A: errno ~D"
                    (engine-temp-directory engine) errno)
      (return-from spool-to-disk nil))
    (setf (spool-fd spool) fd)
    (sb-ext:atomic-incf (engine-body-files engine))
    (let ((fill (spool-fill spool))
          (memory (spool-memory spool)))
      (setf (spool-fill spool) 0
            (spool-memory spool) nil)
      (unwind-protect
           (loop for k from 0
                 for start from 0 below fill by +buffer-size+
                 always (spool-write engine spool (svref memory k)
                                     0 (min +buffer-size+ (- fill start))))
        (free-memory engine spool memory)))))

(defun free-memory (engine spool memory)
  "Give back the buffers of MEMORY, SPOOL's memory, and their budget."
  (when memory
    (loop for buffer across memory
          when buffer do (release-buffer buffer))
    (body-bytes-incf engine (- (spool-charged spool)))
    (account-add :bodies (- (spool-charged spool)))
    (setf (spool-charged spool) 0)))

(defun spool-write (engine spool buffer start end)
  "Append BUFFER[START,END) to SPOOL's file.  NIL when the disk budget or
the disk is full."
  (declare (type octets buffer) (type fixnum start end))
  (let ((n (- end start)))
    (unless (charge-budget engine #'disk-bytes-incf
                           (engine-disk-budget engine) n)
      (return-from spool-write nil))
    (incf (spool-disk spool) n)
    (let ((errno (write-fd-all (spool-fd spool) buffer start end)))
      (when errno
        (spool-failed engine "Writing a request body to a temporary file in ~A: errno ~D"
                      (engine-temp-directory engine) errno)
        (return-from spool-write nil)))
    (incf (spool-fill spool) n)
    t))

(defun spool-append (engine spool buffer start end)
  "Add BUFFER[START,END) to the body held in SPOOL: in memory while it fits
in BODY-BUFFER-BYTES and the body budget, else in a temporary file.  NIL
when it could not be held (the disk budget is spent, or the file failed)."
  (declare (type octets buffer) (type fixnum start end))
  (when (and (< (spool-fd spool) 0)
             (or (> (+ (spool-fill spool) (- end start)) (engine-body-buffer-bytes engine))
                 (not (spool-to-memory engine spool buffer start end))))
    ;; Past this body's share of memory, or past the budget: to disk.
    (unless (spool-to-disk engine spool)
      (return-from spool-append nil)))
  (or (< (spool-fd spool) 0)
      (spool-write engine spool buffer start end)))

(defun spool-to-memory (engine spool buffer start end)
  "Append BUFFER[START,END) to SPOOL's memory, taking buffers as needed.
NIL (nothing appended) when they would exceed the body budget."
  (declare (type octets buffer) (type fixnum start end))
  (let* ((fill (spool-fill spool))
         (want (+ fill (- end start)))
         (have (* +buffer-size+ (floor (spool-charged spool) +buffer-size+)))
         (more (- (* +buffer-size+ (ceiling want +buffer-size+)) have)))
    (declare (type fixnum fill want have more))
    (when (plusp more)
      (unless (charge-budget engine #'body-bytes-incf (engine-body-budget engine) more)
        (return-from spool-to-memory nil))
      ;; Under pressure (the overload level, account.lisp) a body longer
      ;; than one buffer goes to disk instead, and past the account's limit
      ;; any.  Charged and noted with interrupts off: a handler deadline's
      ;; interrupt between the two would leave the charge for good.
      (unless (sb-sys:without-interrupts
                (when (and (or (<= want +buffer-size+) (zerop (overload-level)))
                           (account-charge :bodies more))
                  (incf (spool-charged spool) more)
                  t))
        (body-bytes-incf engine (- more))
        (return-from spool-to-memory nil))
      (let* ((count (ceiling want +buffer-size+))
             (old (spool-memory spool))
             (memory (if (and old (<= count (length old)))
                         old
                         (let ((new (make-array (max count 4) :initial-element nil)))
                           (when old (replace new old))
                           new))))
        (loop for k from (floor have +buffer-size+) below count
              do (setf (svref memory k) (acquire-buffer)))
        (setf (spool-memory spool) memory)))
    (let ((memory (spool-memory spool)))
      (loop while (< start end)
            do (multiple-value-bind (k offset) (floor fill +buffer-size+)
                 (let ((n (min (- end start) (- +buffer-size+ offset))))
                   (replace (the octets (svref memory k)) buffer
                            :start1 offset :start2 start :end2 (+ start n))
                   (incf start n)
                   (incf fill n)))))
    (setf (spool-fill spool) want)
    t))

(defun spool-read (spool vector start end)
  "Copy the next octets of SPOOL into VECTOR[START,END): as many as fit and
are left.  Returns the index after the last one copied."
  (declare (type fixnum start end))
  (let* ((pos (spool-read-pos spool))
         (n (min (- end start) (- (spool-fill spool) pos))))
    (declare (type fixnum pos n))
    (cond ((<= n 0) start)
          ((spool-memory spool)
           (multiple-value-bind (k offset) (floor pos +buffer-size+)
             (let ((n (min n (- +buffer-size+ offset))))
               (replace vector (the octets (svref (spool-memory spool) k))
                        :start1 start :end1 (+ start n) :start2 offset)
               (setf (spool-read-pos spool) (+ pos n))
               (+ start n))))
          ((and (typep vector 'octets) (>= n +buffer-size+))
           ;; A large read: straight from the file.
           (let ((k (spool-pread spool vector start (+ start n) pos)))
             (setf (spool-read-pos spool) (+ pos k))
             (+ start k)))
          (t
           (unless (and (spool-window spool)
                        (<= (spool-window-start spool) pos)
                        (< pos (spool-window-end spool)))
             (let ((window (or (spool-window spool)
                               (setf (spool-window spool) (acquire-buffer)))))
               (setf (spool-window-start spool) pos
                     (spool-window-end spool)
                     (+ pos (spool-pread spool window 0
                                         (min (length window) (- (spool-fill spool) pos))
                                         pos)))))
           (let ((k (min n (- (spool-window-end spool) pos))))
             (replace vector (the octets (spool-window spool))
                      :start1 start :end1 (+ start k)
                      :start2 (- pos (spool-window-start spool)))
             (setf (spool-read-pos spool) (+ pos k))
             (+ start k))))))

(defun spool-pread (spool buffer start end offset)
  "Read SPOOL's file from OFFSET into BUFFER[START,END): the count, at
least 1.  A file that fails to give back what was written is a fault of
the machine, not of the request: an error."
  (multiple-value-bind (n errno) (pread-into (spool-fd spool) buffer start end offset)
    (if (plusp n)
        n
        (error "Reading a request body back from its temporary file failed: ~
                ~:[it is shorter than written~;errno ~:*~D~]"
               (and (minusp n) errno)))))

(defun free-spool (engine spool)
  "Give back what SPOOL holds: its memory, its file, their budgets."
  (free-memory engine spool (shiftf (spool-memory spool) nil))
  (when (>= (spool-fd spool) 0)
    (close-fd (shiftf (spool-fd spool) -1))
    (disk-bytes-incf engine (- (spool-disk spool)))
    (setf (spool-disk spool) 0))
  (when (spool-window spool)
    (release-buffer (shiftf (spool-window spool) nil)))
  (setf (spool-fill spool) 0
        (spool-read-pos spool) 0)
  nil)
