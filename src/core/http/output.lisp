;;;; output.lisp -- writing on a connection: its output buffer, SEND-ALL,
;;;; the Gray stream's output methods, the octet interface the layers above
;;;; write answers with, and files sent with sendfile(2).
;;;;
;;;; Every write goes through SEND-ALL, CONNECTION-WRITE-SEGMENT or
;;;; CONNECTION-SEND-FILE, which send after what is queued and queue what the
;;;; socket does not take (output-queue.lisp, whose rules hold here): order
;;;; on the wire is the order of the writes.  Invariant: the output buffer
;;;; holds OUT-FILL octets not sent yet, which go before any later write.
;;;; Nothing here knows HTTP: what is written is the layers' above.

(in-package #:gallop.core)

(defun send-all (c buffer start end &optional (keep :copy))
  "Send BUFFER[START,END) after C's unsent output.  What the socket does not
take now is queued (output-queue.lisp): KEEP :COPY copies it, :REFERENCE
keeps BUFFER itself, :HAND-OVER keeps BUFFER, a pooled buffer, and gives it
back once sent.  Past MAX-UNSENT-BYTES a copy or a hand-over is copied into a spill
buffer instead (SPILL-UNSENT), charged to the memory account, and waits for
the client when the account refuses (WAIT-FOR-ROOM).  Returns :KEPT when
BUFFER itself was queued.  On a RAW connection, blocks until all is sent."
  (declare (type octets buffer) (type fixnum start end))
  (when (conn-slot c source)
    (return-from send-all (send-to-source c buffer start end)))
  (when (conn-slot c gone)
    (return-from send-all nil))
  (let ((engine (connection-engine c)))
    (when (conn-slot c raw)
      (when (conn-slot c unsent) (finish-unsent c))
      (let ((timeout (engine-write-timeout-ms engine)))
        (loop while (< start end)
              ;; Through CONNECTION-SEND: a detached connection on the
              ;; engine's own TLS still speaks TLS.
              do (multiple-value-bind (n errno) (connection-send c buffer start end)
                   (declare (type fixnum n))
                   (cond ((>= n 0) (incf start n) (incf (the fixnum (conn-slot c sent)) n))
                         ((= errno +eagain+) (wait-for-fd c +pollout+ timeout "write"))
                         (t (client-went-away c errno "write"))))))
      (return-from send-all nil))
    (let ((spill nil)   ; past MAX-UNSENT-BYTES: a new spill buffer's size (charged), or 0
          (refused nil)) ; why MAY-QUEUE-P said no: :OWN (C's spill limit) or :ACCOUNT
      (flet ((may-queue-p ()
               ;; What is left may join the queue now (output-queue.lisp);
               ;; NIL when the account refused it.
               (or (eq keep :reference)
                   (conn-slot c upgrade)
                   (<= (+ (conn-slot c unsent-bytes) (- end start))
                       (engine-max-unsent-bytes engine))
                   (progn
                     (when (reader-stalled-p c)
                       (reader-timed-out c))
                     (let ((short (- end start (spill-room c))))
                       (if (<= short 0)
                           (setf spill 0)
                           (let ((size (max short +spill-octets+)))
                             (cond ((> (+ (conn-slot c unsent-bytes) size) (spill-limit))
                                    (setf refused :own)
                                    nil)
                                   ;; Charged and noted at once: an interrupt
                                   ;; (a handler deadline) between the two
                                   ;; would leave the charge for good.
                                   ((sb-sys:without-interrupts
                                      (and (account-charge :output (octets-footprint size))
                                           (setf spill size))))
                                   (t (setf refused :account)
                                      nil))))))))
             (wait ()
               ;; C's own spill limit, memory plentiful: wait for its client
               ;; as a writer past it always did (the write timeout and the
               ;; minimum rate bound it).  The account: bounded waiting.
               (wait-for-room c :bounded (not (and (eq refused :own)
                                                   (zerop (overload-level)))))))
        (unwind-protect
            (progn
              (loop while (< start end)
                    do (if (or (null (conn-slot c unsent)) (send-unsent c))
                           ;; Nothing queued: straight to the socket.
                           (multiple-value-bind (n errno) (connection-send c buffer start end)
                             (cond ((>= n 0) (incf start n) (incf (the fixnum (conn-slot c sent)) n))
                                   ((/= errno +eagain+) (client-went-away c errno "write"))
                                   ((may-queue-p) (return))
                                   (t (wait))))
                           ;; Queued output waits: queue behind it, or wait for room.
                           (if (may-queue-p)
                               (return)
                               (wait))))
              (when (< start end)
                (when (conn-slot c shed)
                  ;; The overload manager closes C: nothing more is queued for it
                  ;; (the spill buffer's charge is given back below).
                  (set-reset-on-close (connection-fd c))
                  (error 'connection-error :stream c :operation "write (shed: the server is short of memory)"))
                (if spill
                    (sb-sys:without-interrupts
                      (spill-unsent c buffer start end spill)
                      ;; Queued: its charge is the queue's now.
                      (setf spill nil))
                    (ecase keep
                      (:copy (queue-unsent c (make-segment (subseq buffer start end) 0 (- end start))))
                      (:reference (queue-unsent c (make-segment buffer start end)) :kept)
                      (:hand-over
                       (if (< (* 2 (- end start)) (length buffer))
                           ;; Mostly empty (a writer's flush after a short
                           ;; write): a copy costs what it holds, the buffer more.
                           (queue-unsent c (make-segment (subseq buffer start end) 0 (- end start)))
                           (progn (queue-unsent c (make-segment buffer start end t)) :kept)))))))
          ;; Charged and not queued (an error, the shed, an interrupt): given back.
          (when (and spill (plusp spill))
            (account-add :output (- (octets-footprint spill)))))))))

(declaim (inline output-buffer))
(defun output-buffer (c)
  "C's output buffer, taken from the pool if C has none."
  (or (conn-slot c outbuf) (setf (conn-slot c outbuf) (acquire-buffer))))

(defun flush-output (c)
  "Send what C's output buffer holds (see SEND-ALL): afterwards the buffer is
empty, or, when the socket did not take all of it, handed to the queue (the
next write takes a fresh one)."
  (with-connection-slots (outbuf out-fill) c
    (when (plusp out-fill)
      (let ((n out-fill))
        (setf out-fill 0)
        (when (eq (send-all c outbuf 0 n :hand-over) :kept)
          (setf outbuf nil))))))

(defmethod sb-gray:stream-write-byte ((c connection) byte)
  (with-connection-slots (outbuf out-fill) c
    (when (and outbuf (= out-fill (length (the octets outbuf))))
      (flush-output c))
    (let ((buffer (output-buffer c)))
      (declare (type octets buffer))
      (setf (aref buffer out-fill) byte)
      (incf out-fill)
      byte)))

(defmethod sb-gray:stream-write-sequence ((c connection) sequence &optional (start 0) end)
  (with-connection-slots (out-fill) c
    (let* ((end (or end (length sequence)))
           (buffer (output-buffer c)))
      (declare (type octets buffer) (type fixnum start end))
      (cond ((and (typep sequence 'octets) (> (- end start) (- (length buffer) out-fill)))
             ;; Too big for the buffer: send what is buffered, then the data itself.
             (flush-output c)
             (if (> (- end start) (length buffer))
                 ;; The caller's octets: copied if queued, unless they are
                 ;; the whole body the layer above gave up.
                 (send-all c sequence start end
                           (if (and (conn-slot c body-given) (zerop start) (= end (length sequence)))
                               (progn (setf (conn-slot c body-given) nil) :reference)
                               :copy))
                 (progn (replace (the octets (output-buffer c)) sequence :start2 start :end2 end)
                        (setf out-fill (- end start)))))
            ((typep sequence 'octets)
             (replace buffer sequence :start1 out-fill :start2 start :end2 end)
             (incf out-fill (- end start)))
            (t
             (loop for i from start below end
                   do (sb-gray:stream-write-byte c (elt sequence i)))))
      sequence)))

(defmethod sb-gray:stream-force-output ((c connection))
  (flush-output c)
  nil)

(defmethod sb-gray:stream-finish-output ((c connection))
  (flush-output c)
  nil)

(defmethod sb-gray:stream-clear-output ((c connection))
  (setf (conn-slot c out-fill) 0)
  nil)

;;; The octet interface the native layer uses: no generic dispatch.

;;; The same contract as SEND-ALL's KEEP: a native app's response body is
;;; given up by the app (:REFERENCE), a streaming writer's data is copied.
(defun connection-write-octets (c octets &optional (start 0) (end (length octets)) (keep :copy))
  "Buffer OCTETS[START,END) for sending; large ones are sent directly (what
the socket does not take then is queued as KEEP says, see SEND-ALL)."
  (declare (type octets octets) (type fixnum start end))
  (with-connection-slots (out-fill) c
    (let ((buffer (output-buffer c)))
      (declare (type octets buffer))
      (cond ((<= (- end start) (- (length buffer) out-fill))
             (replace buffer octets :start1 out-fill :start2 start :end2 end)
             (incf out-fill (- end start)))
            ((<= (- end start) (length buffer))
             (flush-output c)
             (replace (the octets (output-buffer c)) octets :start2 start :end2 end)
             (setf out-fill (- end start)))
            (t
             (flush-output c)
             (send-all c octets start end keep)))))
  nil)

(defun connection-write-segment (c segment)
  "Send SEGMENT (octets in memory, not empty, given up by the caller) after
C's output, without waiting: what the socket does not take now is queued as
SEGMENT itself, its octets neither copied nor written to (shared ones stay
shared).  An upgraded connection's sends come this way (upgrade.lisp).
Signals CONNECTION-ERROR when the client went away; SEGMENT is let go of
whatever happens to C."
  (declare (type segment segment))
  (let ((kept nil))
    (unwind-protect
         (progn
           (flush-output c)
           (when (conn-slot c gone)
             (return-from connection-write-segment nil))
           (when (or (null (conn-slot c unsent)) (send-unsent c))
             ;; Nothing queued: straight to the socket.
             (loop while (< (segment-start segment) (segment-end segment))
                   do (multiple-value-bind (n errno)
                          (connection-send c (segment-octets segment)
                                           (segment-start segment) (segment-end segment))
                        (declare (type fixnum n))
                        (cond ((>= n 0)
                               (incf (segment-start segment) n)
                               (incf (the fixnum (conn-slot c sent)) n))
                              ((= errno +eagain+) (return))
                              (t (client-went-away c errno "write"))))))
           (when (< (segment-start segment) (segment-end segment))
             (queue-unsent c segment)
             (setf kept t)))
      (unless kept (free-segment segment))))
  nil)

(defun connection-reserve-output (c n)
  "Room for N octets in C's output buffer, sending what it holds first if
needed: returns the buffer and the index to write at, or NIL if N octets do
not fit even an empty buffer.  The caller fills the buffer from that index
and then calls CONNECTION-COMMIT-OUTPUT with the index after its last octet."
  (declare (type fixnum n))
  (with-connection-slots (out-fill) c
    (let ((buffer (output-buffer c)))
      (declare (type octets buffer))
      (cond ((<= n (- (length buffer) out-fill)) (values buffer out-fill))
            ((<= n (length buffer))
             (flush-output c)
             ;; A fresh buffer when the socket did not take all of the old one.
             (values (output-buffer c) 0))
            (t nil)))))

(declaim (inline connection-commit-output))
(defun connection-commit-output (c fill)
  "The output buffer now holds octets up to FILL (see CONNECTION-RESERVE-OUTPUT)."
  (setf (conn-slot c out-fill) fill))

(defun connection-flush (c)
  "Send everything buffered (what the socket does not take now is queued)."
  (flush-output c))

(defun connection-send-file (c file-fd offset count)
  "Send COUNT bytes of the open file FILE-FD from OFFSET with sendfile(2),
after what is buffered.  What the socket does not take now is queued with a
duplicate of FILE-FD, so the caller may close FILE-FD when this returns."
  (flush-output c)
  (when (conn-slot c gone)
    (return-from connection-send-file))
  (let ((timeout (engine-write-timeout-ms (connection-engine c))))
    (loop while (plusp count)
          do (multiple-value-bind (n errno)
                 (if (and (conn-slot c unsent) (not (send-unsent c)))
                     (values -1 +eagain+) ; queued output waits: as if the socket were full
                     (connection-send-file-chunk c file-fd offset count))
               (cond ((plusp n) (incf offset n) (decf count n)
                      (incf (the fixnum (conn-slot c sent)) n))
                     ((and (minusp n) (= errno +eagain+))
                      (let ((copy (if (conn-slot c raw) -1 (dup-fd file-fd))))
                        (when (>= copy 0)
                          (queue-unsent c (make-segment nil offset (+ offset count) nil copy))
                          (return))
                        ;; A blocking connection (TLS, detached), or no fd to spare.
                        (finish-unsent c)
                        (wait-for-fd c +pollout+ timeout "sendfile")))
                     ((zerop n) (error 'connection-error :stream c :operation "sendfile (file shrank)"))
                     (t (client-went-away c errno "sendfile")))))))
