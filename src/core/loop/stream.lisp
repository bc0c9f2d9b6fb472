;;;; stream.lisp -- the connection as the binary stream the layer above
;;;; reads a request from, and closes.
;;;;
;;;; Reads end where the request ends (READ-MESSAGE, body.lisp; the
;;;; plaintext side of TLS reads its next head itself, READ-NEXT-HEAD,
;;;; tls.lisp).  After CONNECTION-MARK-BOUNDARY the next read is at the
;;;; boundary between two requests (LEAVE-BOUNDARY): it goes on when a new
;;;; request may be read now on this stream, and otherwise answers end of
;;;; file, so that the request loop of the layer above ends and the
;;;; connection goes back to the engine, which parks it, serves its next
;;;; buffered request, or closes it.  CLOSE only records that the layer
;;;; above is done with the connection, unless it was detached.  The output
;;;; methods are with the output queue (output.lisp, output-queue.lisp).

(in-package #:gallop.core)

;;; Between requests

(defun leave-boundary (c)
  "Called on the first read after CONNECTION-MARK-BOUNDARY.  True when a new
request may be read now on this stream; NIL (end of file for the reader)
when the connection goes back to the engine instead: the request loop above
ends and its handler returns :KEEP-ALIVE, and the engine decides whether C
parks, serves its next buffered request, or closes (RUN-HANDLER,
SERVE-CONNECTION).  The plaintext side of TLS reads its next request itself
\(PLAIN-LEAVE-BOUNDARY)."
  (with-connection-slots (boundary) c
    (cond ((conn-slot c detaching)
           ;; Detached: the stream is the handler's, requests are over.
           (setf boundary nil)
           t)
          ((conn-slot c source) (plain-leave-boundary c))
          (t nil))))

(defun plain-leave-boundary (c)
  "LEAVE-BOUNDARY for the plain connection C: skip what the handler left of
its request, then wait for the next one (bounded by the idle timeout, and
given up when the engine stops).  True when a request may be read now."
  (let* ((cipher (conn-slot c cipher))
         (engine (connection-engine c)))
    (setf (request-message (connection-request c)) nil
          (conn-slot c boundary) nil)
    (release-buffers c)                 ; an empty (grown) input buffer, and its budget
    (when (or (not (finish-message c))
              (request-close-after (connection-request c))
              (conn-slot cipher interrupted) ; the handler ran past its deadline
              (not (engine-running-p engine)))
      (return-from plain-leave-boundary nil))
    (when (and (= (conn-slot c in-start) (conn-slot c in-end))
               ;; Ciphertext already read from the socket, or plaintext
               ;; the TLS library decrypted and holds: a pipelined request
               ;; is there, and no event will say so.
               (= (conn-slot cipher in-start) (conn-slot cipher in-end))
               (not (let ((pending (conn-slot c pending)))
                      (and pending (ignore-errors (funcall pending))))))
      ;; Nothing here: wait for the next request without counting as in
      ;; flight (a soft stop does not wait for an idle TLS client).
      (sb-sys:without-interrupts
        (disarm-handler-deadline cipher)
        (end-in-flight cipher))
      (let ((ready (unwind-protect
                        (poll-fds (connection-fd c) +pollin+ (engine-stop-fd engine)
                                  (engine-idle-timeout-ms engine))
                     (begin-in-flight cipher))))
        (unless (eq ready :ready)
          (return-from plain-leave-boundary nil))))
    ;; The next request on this TLS connection gets a deadline of its own.
    (arm-handler-deadline cipher)
    (engine-running-p engine)))

(defun connection-take-head (c)
  "For a layer above that reads request heads from the record instead of
through the stream: C's request record, with the head consumed (the stream
now reads the body), when the next read would start a checked head.  :EOF
when that read would answer end of file instead (no further request now:
the same steps as a read, see LEAVE-BOUNDARY).  NIL when the head can only
be read through the stream (part of it was read already, or C is raw)."
  (with-connection-slots (boundary raw in-start request) c
    (with-request-slots (head-left message) request
      (cond ((or raw (conn-slot c detaching)) nil)
            ((and boundary (not (leave-boundary c))) :eof)
            ((and (conn-slot c source) (not message) (not (read-next-head c))) :eof)
            ((and (plusp head-left)
                  (= in-start (request-start request))
                  (= head-left (- (request-end request) (request-start request))))
             (setf in-start (request-end request)
                   head-left 0)
             request)
            (t nil)))))

;;; Gray stream methods

(defmethod stream-element-type ((c connection))
  '(unsigned-byte 8))

(defmethod open-stream-p ((c connection))
  (and (member (connection-state c) '(:active :dirty :detached))
       (not (conn-slot c stream-closed))))

(defmethod sb-gray:stream-read-byte ((c connection))
  (with-connection-slots (inbuf in-start in-end boundary raw) c
    (when (and boundary (not (leave-boundary c)))
      (return-from sb-gray:stream-read-byte :eof))
    (cond ((not raw)
           ;; The request being served, and no further (body.lisp).
           (with-request-slots (message head-left synth-octet) (connection-request c)
             (when (and (conn-slot c source) (not message) (not (read-next-head c)))
               (return-from sb-gray:stream-read-byte :eof))
             (if (and (plusp head-left) (< in-start in-end))
                 (prog1 (aref (the octets inbuf) in-start) ; the head: in the buffer
                   (incf in-start)
                   (decf head-left))
                 (let ((octet (or synth-octet
                                  (setf synth-octet
                                        (make-array 1 :element-type '(unsigned-byte 8))))))
                   (if (= 1 (read-message c octet 0 1))
                       (aref (the octets octet) 0)
                       :eof)))))
          ((or (< in-start in-end) (fill-input c))
           (prog1 (aref (the octets inbuf) in-start)
             (incf in-start)))
          (t :eof))))

(defmethod sb-gray:stream-listen ((c connection))
  (with-connection-slots (in-start in-end raw) c
    (with-request-slots (head-left body-mode body-left) (connection-request c)
      (if (and (eq body-mode :spool) (zerop head-left))
          (plusp body-left)
          (and (< in-start in-end)
               (or raw (plusp head-left) (and body-mode t)))))))

(defmethod sb-gray:stream-read-sequence ((c connection) sequence &optional (start 0) end)
  (with-connection-slots (inbuf in-start in-end boundary raw) c
    (let ((end (or end (length sequence))))
      (when (and boundary (< start end) (not (leave-boundary c)))
        (return-from sb-gray:stream-read-sequence start))
      (unless raw
        (return-from sb-gray:stream-read-sequence
          (if (and (conn-slot c source) (not (request-message (connection-request c)))
                   (< start end) (not (read-next-head c)))
              start
              (read-message c sequence start end))))
      (loop while (< start end)
            do (when (and (= in-start in-end) (not (fill-input c)))
                 (return))
               (let ((n (min (- end start) (- in-end in-start))))
                 (replace sequence (the octets inbuf)
                          :start1 start :end1 (+ start n) :start2 in-start)
                 (incf start n)
                 (incf in-start n)))
      start)))

(defmethod close ((c connection) &key abort)
  "While a worker serves C this only records that the layer above is done
with it; the worker then parks or closes it.  A detached connection is closed
at once, or, while its worker has not let go of it yet (the handler has not
returned), by that worker when it does (LET-GO-DETACHED)."
  (case (connection-state c)
    ((:active :dirty)
     (unless (conn-slot c stream-closed)
       (if abort
           (setf (conn-slot c out-fill) 0)
           (ignore-errors (flush-output c)))
       (setf (conn-slot c stream-closed) t)
       (cond ((conn-slot c source)
              ;; The plaintext side of TLS: closing the TLS stream ends the
              ;; session and closes the cipher connection under it.
              (release-buffers c)
              (uncharge-head c)         ; a buffer still holding input
              (ignore-errors (close (conn-slot c source) :abort abort)))
             ((conn-slot c detaching)
              ;; Its owner closes it, maybe on another thread, while the
              ;; worker still holds C: left to the worker, unless the
              ;; worker let go meanwhile.
              (when (eq :let-go (sb-ext:compare-and-swap (%conn-slot c detaching) t :closed))
                (close-connection c))))))
    (:detached
     (unless abort (ignore-errors (flush-output c)))
     (setf (conn-slot c out-fill) 0)
     (close-connection c)))
  t)
