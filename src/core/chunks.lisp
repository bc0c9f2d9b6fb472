;;;; chunks.lisp -- reading and checking a chunked request body before the
;;;; handler runs.
;;;;
;;;; Hunchentoot decodes chunked bodies with chunga inside the handler.  Bad
;;;; framing then costs two log entries and no answer at all (Hunchentoot
;;;; drains the body again before it writes its 500, and fails again), and a
;;;; chunked body has no size limit.  When the engine's CHECK-CHUNKED-BODIES is
;;;; on, the worker first reads the whole chunked body into the connection's
;;;; input buffer, checking its framing as it arrives, and answers 400 (bad
;;;; framing) or 413 (over MAX-BODY-BYTES) itself; the handler then reads a
;;;; body known to be well formed, unchanged, from the buffer.
;;;;
;;;; The checker is a state machine over the body's bytes:
;;;;   :SIZE      hex digits of a chunk size (1 to 15 of them)
;;;;   :SIZE-WS   spaces or tabs after the size
;;;;   :EXT       a chunk extension after ';', up to CR
;;;;   :SIZE-LF   LF after the size line's CR
;;;;   :DATA      CHUNK-LEFT bytes of chunk data (skipped in bulk)
;;;;   :DATA-CR   CR after the data, then :DATA-LF for its LF
;;;;   :TRAILER   at the start of a trailer line: CR ends the body
;;;;   :FIELD     inside a trailer field line, up to CR (then :FIELD-LF)
;;;;   :LAST-LF   LF of the blank line that ends the body
;;;; and NIL once the body ended (or when not checking).
;;;;
;;;; Invariants: HEAD-LEFT counts the bytes of the request head still to be
;;;; passed before the body starts; the checker sees only bytes after them.
;;;; LINE counts the bytes of the current size, extension or trailer line
;;;; (bounded by +MAX-CHUNK-LINE+).

(in-package #:gallop.core)

(define-condition request-body-error (error)
  ((status :initarg :status :reader request-body-error-status))
  (:report (lambda (c s)
             (format s "~:[The chunked request body is malformed~;~
                        The chunked request body is over the size limit~] (~D)."
                     (= 413 (request-body-error-status c)) (request-body-error-status c))))
  (:documentation "Signalled by CHECK-BODY-BYTES for a chunked request body
whose framing is wrong (STATUS 400) or which grows past the engine's
MAX-BODY-BYTES (413)."))

(defconstant +max-chunk-line+ 1024
  "The longest chunk size line (with extensions) or trailer line accepted.")

(defun start-body-check (c head-bytes)
  "Begin checking the chunked body of the request whose head, HEAD-BYTES
long, is about to be read from C."
  (with-connection-slots (body-check head-left chunk-left chunk-total line) c
    (setf body-check :size head-left head-bytes chunk-left 0 chunk-total 0 line 0)))

(defun body-check-fail (c status)
  (setf (conn-slot c body-check) nil)
  (error 'request-body-error :status status))

(defun check-body-bytes (c buffer start end)
  "Feed BUFFER[START,END), bytes just read from C, to C's chunked-body checker."
  (declare (type octets buffer) (type fixnum start end))
  (with-connection-slots (body-check head-left chunk-left chunk-total line engine) c
    (declare (type fixnum head-left chunk-left chunk-total line))
    (let ((skip (min head-left (- end start))))
      (decf head-left skip)
      (incf start skip))
    (loop while (and body-check (< start end))
          do (let ((b (aref buffer start)))
               (flet ((next (state) (setf body-check state))
                      (bad () (body-check-fail c 400)))
                 (incf start)
                 (case body-check
                   (:size
                    (let ((digit (digit-char-p (code-char b) 16)))
                      (cond (digit
                             (when (>= line 15) (bad))
                             (setf chunk-left (+ (* 16 chunk-left) digit))
                             (incf line))
                            ((zerop line) (bad))
                            ((or (= b 32) (= b 9)) (next :size-ws))
                            ((= b 59) (next :ext))
                            ((= b 13) (next :size-lf))
                            (t (bad)))))
                   (:size-ws
                    (cond ((or (= b 32) (= b 9)))
                          ((= b 59) (next :ext))
                          ((= b 13) (next :size-lf))
                          (t (bad))))
                   (:ext
                    (cond ((= b 13) (next :size-lf))
                          ((or (= b 10) (= b 0) (>= (incf line) +max-chunk-line+)) (bad))))
                   (:size-lf
                    (unless (= b 10) (bad))
                    (setf line 0)
                    (cond ((zerop chunk-left) (next :trailer))
                          ((> (incf chunk-total chunk-left) (engine-max-body-bytes engine))
                           (body-check-fail c 413))
                          (t (next :data))))
                   (:data
                    ;; B is the first data byte; skip the rest of the chunk in bulk.
                    (let ((n (min (1- chunk-left) (- end start))))
                      (incf start n)
                      (decf chunk-left (1+ n))
                      (when (zerop chunk-left) (next :data-cr))))
                   (:data-cr (if (= b 13) (next :data-lf) (bad)))
                   (:data-lf (if (= b 10) (next :size) (bad)))
                   (:trailer
                    (cond ((= b 13) (next :last-lf))
                          ((= b 10) (bad))
                          (t (setf line 1) (next :field))))
                   (:field
                    (cond ((= b 13) (next :field-lf))
                          ((or (= b 10) (= b 0) (>= (incf line) +max-chunk-line+)) (bad))))
                   (:field-lf (if (= b 10) (next :trailer) (bad)))
                   (:last-lf (if (= b 10) (next nil) (bad)))))))))

(defun read-chunked-body (c)
  "Read the rest of the chunked body of the request whose head was just
checked on C into C's input buffer, checking it.  Returns NIL when the whole
body is buffered, 400 or 413 when it must be refused, or :CLOSED when the
client went away.  Blocks (bounded by the read timeout) in a worker."
  (with-connection-slots (fd inbuf in-start in-end scan engine body-check expect-continue) c
    (start-body-check c (- scan in-start))
    (handler-case
        (progn
          (check-body-bytes c inbuf in-start in-end)
          (when (and body-check expect-continue)
            (let ((continue +response-100+))
              (send-from fd continue 0 (length continue))))
          (loop while body-check
                do (unless (make-room c (+ (engine-max-body-bytes engine)
                                           (engine-max-head-bytes engine)))
                     (return-from read-chunked-body 413))
                   (let ((buffer inbuf))
                     (multiple-value-bind (n errno) (read-into fd buffer in-end (length buffer))
                       (setf (conn-slot c drained) (< n (- (length buffer) in-end)))
                       (cond ((plusp n)
                              (check-body-bytes c buffer in-end (+ in-end n))
                              (incf in-end n))
                             ((and (minusp n) (= errno +eagain+))
                              (wait-for-fd c +pollin+ (engine-read-timeout-ms engine) "read body"))
                             (t (return-from read-chunked-body :closed)))))))
      (request-body-error (e) (request-body-error-status e))
      (connection-timeout-error () :closed))))
