;;;; http1.lisp -- HTTP/1.1's syntax on a connection: where a request head
;;;; ends in its input, the request line as received, the boundary between
;;;; one request and the next, and the pieces answer heads are written with.
;;;;
;;;; The files this one is built on know no HTTP/1.1 syntax; head.lisp and
;;;; body.lisp, built on it, parse a head and read a body.  The layers above
;;;; write status lines and header fields with CONNECTION-WRITE-LATIN1,
;;;; -ASCII and -DECIMAL; a header value is written as latin-1 with CR, LF
;;;; and the other controls but TAB replaced (LATIN1-OCTET), so that no value
;;;; can end its field.  100 Continue is an interim answer: it does not count
;;;; as the start of the response (SENT stays 0).

(in-package #:gallop.core)

;;; The request line, for the log of an answer the engine gave itself

(defconstant +logged-line-octets+ 8192
  "The most octets of a refused request's line given to the layer above's
log: nginx logs at most what its header buffer holds, 8 KiB by default, and
a client that sends a longer line costs the log no more than that.")

(defun received-line-end (c)
  "The end of the request line (or of what came of it) in C's input from
IN-START: its first CR or LF, else IN-END, at most +LOGGED-LINE-OCTETS+
on; NIL when C holds no input."
  (with-connection-slots (inbuf in-start in-end) c
    (when (and inbuf (< in-start in-end))
      (let ((buffer inbuf)
            (end (min in-end (+ in-start +logged-line-octets+))))
        (declare (type octets buffer) (type fixnum end))
        (loop for i of-type fixnum from in-start below end
              when (or (= (aref buffer i) +cr+) (= (aref buffer i) +lf+))
                return i
              finally (return end))))))

(defun note-refusal (c response sent &key (line t) (log t))
  "RESPONSE, one of the engine's own answers (its status line at the start),
went to the request C was reading, the socket taking SENT octets of it (all
of it when the rest waits with C): count it for the metrics, and give it to
the engine's LOG-ANSWER (unless LOG is NIL: the layer above logged it
already), unless an answer to that request was counted already (its layer
above then logged it).  LOG-ANSWER is called in this
thread (a worker, the housekeeper, the layer above's listener) as (LOG-ANSWER
C STATUS BODY-OCTETS-SENT BUFFER START END), BUFFER[START,END) the request
line as received (when LINE, the input is at C's IN-START, up to
RECEIVED-LINE-END), BUFFER NIL when nothing of it came or it is gone.  The
head is in C's record only while CONNECTION-HEAD-PENDING-P.  LOG-ANSWER
must not block, nor keep BUFFER: C's buffers go back to the pool next."
  (declare (type octets response) (type fixnum sent))
  (unless (let ((request (connection-request c)))
            (and (plusp (request-begun request)) (request-answered request)))
    (let ((status (response-status response))
          (engine (connection-engine c)))
      (connection-count-answer c status)
      (let ((log (and log (engine-log-answer engine))))
        (when log
          (let ((end (and line (received-line-end c))))
            (handler-case
                (funcall log c status (response-body-sent response sent)
                         (and end (conn-slot c inbuf)) (if end (conn-slot c in-start) 0) (or end 0))
              (error (e) (log-engine-error engine "Logging an answer on ~A: ~A" c e)))))))))

;;; The boundary between requests

(defun connection-mark-boundary (c)
  "Tell C that a response is complete and the next read starts a new request.
That read answers end-of-file (ending the layer above's request loop) unless a
complete request head is already buffered; the connection is then parked in
epoll rather than closed."
  (setf (conn-slot c boundary) t))

;;; Finding the end of a request head

(defconstant +max-blank-lines+ 8
  "Empty lines skipped before a request line, at most, between two requests.")

(defun scan-head (c)
  "Look for the end of the request head in the unread input (an empty line:
LF LF, or LF CR LF, so that a head with bare LFs ends too and is refused by
CHECK-HEAD instead of waiting for its timeout).  Returns :COMPLETE,
:INCOMPLETE, :LINE-TOO-LONG (request line over its limit: 414) or :TOO-LARGE
\(head over its limit: 431).  The limits are checked on the octets received
so far whether or not the head is complete, so they never depend on how the
octets were split into reads."
  (with-connection-slots (inbuf in-start in-end scan engine) c
    (unless inbuf
      (return-from scan-head :incomplete))
    (let ((buffer inbuf)
          (start in-start)
          (end in-end)
          (head-end nil))
      (declare (type octets buffer) (type fixnum start end)
               (optimize (speed 3) (safety 0)))
      ;; Skip empty lines (CRLF) before the request line (RFC 9112, 2.2), a
      ;; few: a client sending nothing but CRLFs, each just before the idle
      ;; timeout, would otherwise hold its connection for ever.  Past them
      ;; they are the start of a head (400, or the header timeout's 408).
      (loop while (and (< (1+ start) end)
                       (= (aref buffer start) +cr+) (= (aref buffer (1+ start)) +lf+)
                       (< (conn-slot c blank-lines) +max-blank-lines+))
            do (incf start 2)
               (incf (conn-slot c blank-lines)))
      (setf in-start start)
      (let ((i (max start (the fixnum scan))))
        (declare (type fixnum i))
        (loop while (< i end)
              do (when (= (aref buffer i) +lf+)
                   (let ((j (1+ i)))
                     (declare (type fixnum j))
                     (when (and (< j end) (= (aref buffer j) +cr+))
                       (incf j))
                     (cond ((>= j end) (return))
                           ((= (aref buffer j) +lf+)
                            (setf head-end (1+ j))
                            (return)))))
                 (incf i))
        (setf scan (or head-end i)))
      (let ((received (- (the fixnum (or head-end end)) start))
            (max-line (engine-max-request-line-bytes engine)))
        (declare (type fixnum received max-line))
        (cond ((and (> received max-line) ; else the request line is within it
                    (> (- (the fixnum (or (line-end buffer start end) end)) start) max-line))
               :line-too-long)
              ((> received (engine-max-head-bytes engine))
               :too-large)
              (head-end :complete)
              (t :incomplete))))))

;;; The request head, and whether the connection closes after it

(defun connection-head (c)
  "The buffer holding the request head just checked, its start and its end
\(just after the blank line).  Once the head was consumed (CONNECTION-
CONSUME-HEAD, CONNECTION-TAKE-HEAD) only the buffer is meant: the record
\(CONNECTION-REQUEST) has the head's positions in it."
  (with-connection-slots (inbuf in-start scan) c
    (values inbuf in-start scan)))

(declaim (inline connection-close-after-p))
(defun connection-close-after-p (c)
  "True when the connection must close after the answer to this request."
  (let ((request (connection-request c)))
    (or (request-close-after request) (request-framing-broken request))))

;;; The interim answer

(defun connection-write-continue (c)
  "Send 100 Continue on C now, as an interim answer: it does not count as
the start of the response."
  (connection-write-octets c +response-100+)
  (flush-output c)
  (setf (conn-slot c sent) 0))

;;; Writing answer heads

(declaim (inline latin1-octet))
(defun latin1-octet (char)
  "CHAR as a latin-1 octet in a header: ? beyond latin-1, a space for CR, LF
and the other control characters but TAB (RFC 9110, 5.5), so that a header
value cannot inject a header or carry bytes a client must refuse."
  (let ((code (char-code char)))
    (cond ((or (and (< code 32) (/= code 9)) (= code 127)) 32)
          ((< code 256) code)
          (t 63))))

(defun put-latin1 (buffer fill string)
  "Copy STRING into BUFFER at FILL as LATIN1-OCTETs; the index after it.
BUFFER must have room."
  (declare (type octets buffer) (type fixnum fill) (type string string))
  ;; One loop per string representation, so that each reads its characters
  ;; directly instead of through a generic accessor.
  (macrolet ((copy (type)
               `(let ((string string))
                  (declare (type ,type string) (optimize speed (safety 0)))
                  (dotimes (i (length string))
                    (setf (aref buffer (+ fill i)) (latin1-octet (char string i)))))))
    (typecase string
      ((simple-array character (*)) (copy (simple-array character (*))))
      (simple-base-string (copy simple-base-string))
      (t (copy string))))
  (+ fill (length string)))

(defun connection-write-latin1 (c string)
  "Buffer the characters of STRING as LATIN1-OCTETs."
  (declare (type string string))
  (multiple-value-bind (buffer fill) (connection-reserve-output c (length string))
    (if buffer
        (connection-commit-output c (put-latin1 buffer fill string))
        (connection-write-octets c (map 'octets #'latin1-octet string))))
  nil)

(defun connection-write-ascii (c string)
  "Buffer the characters of STRING, all below 128, as octets, unchanged."
  (declare (type simple-string string))
  (with-connection-slots (outbuf out-fill) c
    (let ((n (length string)))
      (declare (type fixnum n))
      (loop with start of-type fixnum = 0
            while (< start n)
            do (when (and outbuf (= out-fill (length (the octets outbuf))))
                 (flush-output c))
               (let ((buffer (output-buffer c)))
                 (declare (type octets buffer))
                 (let* ((fill out-fill)
                        (count (min (- n start) (- (length buffer) fill))))
                   (declare (type fixnum fill count))
                   (macrolet ((copy (type)
                                `(let ((string string))
                                   (declare (type ,type string) (optimize speed))
                                   (dotimes (i count)
                                     (setf (aref buffer (+ fill i))
                                           (logand #xff (char-code (schar string (+ start i)))))))))
                     (if (typep string '(simple-array character (*)))
                         (copy (simple-array character (*)))
                         (copy simple-base-string)))
                   (setf out-fill (+ fill count))
                   (incf start count))))))
  nil)

(defun put-decimal (buffer fill n)
  "The decimal digits of the fixnum N >= 0 into BUFFER at FILL; the index
after them.  BUFFER must have room."
  (declare (type octets buffer) (type fixnum fill) (type (and fixnum unsigned-byte) n)
           (optimize speed))
  (let ((digits (if (zerop n) 1 (loop for m of-type fixnum = n then (floor m 10)
                                      while (plusp m) count t))))
    (declare (type fixnum digits))
    (loop for i of-type fixnum from (+ fill digits -1) downto fill
          do (multiple-value-bind (q r) (floor n 10)
               (setf (aref buffer i) (+ 48 r)
                     n q)))
    (+ fill digits)))

(defun connection-write-decimal (c n)
  "Buffer the decimal digits of the non-negative integer N."
  (declare (type (integer 0) n))
  (multiple-value-bind (buffer fill)
      (and (typep n 'fixnum) (connection-reserve-output c 20)) ; a fixnum has at most 19 digits
    (if buffer
        (connection-commit-output c (put-decimal buffer fill n))
        (connection-write-ascii c (format nil "~D" n)))))
