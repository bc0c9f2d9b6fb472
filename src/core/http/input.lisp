;;;; input.lisp -- reading a connection: the read that blocks a worker,
;;;; bounded by the read timeout, a deadline or the minimum data rate, and
;;;; the deadlines of a head or body a parked connection waits for.
;;;;
;;;; FILL-INPUT is the one blocking read into the input buffer, called when
;;;; it holds no unread input (body.lisp and stream.lisp read through it);
;;;; what comes is added at IN-END, and IN-START <= IN-END always.  Its wait
;;;; is READ-WAIT-MS; the loop parks a connection by HEAD-DEADLINES and
;;;; BODY-DEADLINES (lifecycle.lisp).  The plaintext side of TLS through a
;;;; library above the engine (tls.lisp) reads and writes that library's
;;;; stream instead of a socket (FILL-FROM-SOURCE, SEND-TO-SOURCE).

(in-package #:gallop.core)

(defun read-timeout-ms (c)
  "The read timeout of C: for a switched C (see CONNECTION-SWITCH), the one
its handler set, else the engine's UPGRADED-IDLE-TIMEOUT when it has one:
the new protocol's reads wait for the client's next message, not for the
rest of a request; else the engine's READ-TIMEOUT."
  (let ((stream (conn-slot c timeout-stream))
        (engine (connection-engine c)))
    (or (and stream (sb-impl::fd-stream-timeout stream)
             (max 1 (round (* 1000 (sb-impl::fd-stream-timeout stream)))))
        (and (eq (conn-slot c switched) t) (plusp (engine-upgraded-idle-ms engine))
             (engine-upgraded-idle-ms engine))
        (engine-read-timeout-ms engine))))

(defun rate-ended-wait-p (c began)
  "True when the minimum data rate, not a timeout, ended a read on C that
began waiting at BEGAN: the rate's deadline came before the others.  Told
from the deadlines, not the clock, which reads up to a tick behind the
end of the wait."
  (let ((rate (body-rate-deadline c))
        (deadline (conn-slot c read-deadline)))
    (and rate
         (< rate (+ began (read-timeout-ms c)))
         (or (zerop deadline) (< rate deadline)))))

(defun read-wait-ms (c)
  "How long a read on C may wait: the read timeout (a switched C's own, see
CONNECTION-SWITCH), or less when C has a
READ-DEADLINE, or reads a body under the minimum data rate (RATE-START,
see BODY-RATE-DEADLINE) (0 once it passed)."
  (let* ((timeout (read-timeout-ms c))
         (deadline (conn-slot c read-deadline))
         (rate (body-rate-deadline c)))
    (when (and rate (or (zerop deadline) (< rate deadline)))
      (setf deadline rate))
    (if (plusp deadline)
        (max 0 (min timeout (- deadline (now-ms))))
        timeout)))

(declaim (inline earliest))
(defun earliest (deadline other)
  "The earlier of DEADLINE and OTHER (a deadline, or NIL: none)."
  (declare (type fixnum deadline))
  (if (and other (< (the fixnum other) deadline)) other deadline))

(defun body-rate-deadline (c)
  "When the body C's handler reads as it arrives falls under the minimum
data rate (RATE-DEADLINE), or NIL when no rate applies to C now."
  (let* ((request (connection-request c))
         (start (request-rate-start request)))
    (and (plusp start)
         (rate-deadline (connection-engine c) start (request-rate-octets request)))))

(defun body-deadlines (c)
  "The body the engine reads for C (GATHER-BODY): the end of its read
timeout from the last octets, and when it falls under the minimum rate (or
NIL)."
  (values (+ (request-progress (connection-request c))
             (engine-read-timeout-ms (connection-engine c)))
          (body-rate-deadline c)))

(defun head-deadlines (c)
  "The partial request head of C: the end of its header timeout, and when
what came of it falls under the minimum rate (NIL before its first octet,
or during a TLS handshake, whose octets are not counted here)."
  (let ((engine (connection-engine c))
        (started (conn-slot c head-started))
        (octets (- (conn-slot c in-end) (conn-slot c in-start))))
    (values (+ started (engine-header-timeout-ms engine))
            (and (plusp octets) (rate-deadline engine started octets)))))

(defun fill-input (c)
  "Read more input into the empty buffer of C, blocking (bounded by the read
timeout) until some arrives.  Returns NIL at end of file."
  (when (conn-slot c source)
    (return-from fill-input (fill-from-source c)))
  (with-connection-slots (inbuf in-start in-end scan engine) c
    (let ((buffer (ensure-inbuf c)))
      (when (= in-start in-end)
        (setf in-start 0 in-end 0 scan 0))
      (loop
        (multiple-value-bind (n errno) (connection-recv c buffer in-end (length buffer))
          (setf (conn-slot c drained) (< n (- (length buffer) in-end)))
          (cond ((plusp n)
                 (incf in-end n)
                 (with-request-slots (rate-start rate-octets) (connection-request c)
                   (when (plusp rate-start)
                     (incf rate-octets n)))
                 (return t))
                ((zerop n) (return nil))
                ((/= errno +eagain+)
                 (client-went-away c errno "read"))
                (t (wait-for-fd c +pollin+ (read-wait-ms c) "read"))))))))

;;; The plaintext side of TLS through a library above the engine (tls.lisp)
;;; reads and writes its SOURCE, the library's TLS stream, instead of the
;;; socket: FILL-INPUT reads through FILL-FROM-SOURCE, SEND-ALL writes
;;; through SEND-TO-SOURCE.

(defun source-want (c)
  "How many octets C can read from its TLS stream without waiting for more
than the client must send: what is left of a Content-Length body or of a
chunk's data; else 1 (a head, or chunk framing, may end at any octet)."
  (with-request-slots (message head-left body-mode body-left chunk-decoder) (connection-request c)
    (cond ((or (not message) (plusp head-left)) 1)
          ((eq body-mode :length) (max 1 body-left))
          ((and (eq body-mode :chunked) (eq (chunk-decoder-state chunk-decoder) :data))
           (chunk-decoder-left chunk-decoder))
          (t 1))))

(defun fill-from-source (c)
  "Read into C's empty input buffer from its TLS stream, blocking (bounded by
the cipher connection's read timeout or deadline): at most SOURCE-WANT
octets, since the TLS stream only returns when it has all it was asked for
\(and LISTEN on it may block inside cl+ssl's Lisp BIO).  NIL at end of
file, or when the TLS stream failed otherwise (the client went away:
nobody to answer).  Signals HANDLER-TIMEOUT or CONNECTION-TIMEOUT-ERROR when
that is what happened under the TLS library."
  (with-connection-slots (inbuf in-start in-end scan source) c
    (let ((buffer (ensure-inbuf c)))
      (declare (type octets buffer))
      (when (= in-start in-end)
        (setf in-start 0 in-end 0 scan 0))
      (let ((want (min (source-want c) (- (length buffer) in-end))))
        (and (plusp want)
             (handler-case
                 (let ((end (read-sequence buffer source :start in-end :end (+ in-end want))))
                   (when (> end in-end)
                     (setf in-end end)
                     t))
               (error ()
                 ;; The TLS library turned our own condition, raised while it
                 ;; read through the cipher connection, into an error of its
                 ;; own: give the handler-deadline interrupt and the read
                 ;; timeout back their meaning (503 / a quiet close), as on a
                 ;; plain connection.  Anything else: the client is gone.
                 (let ((cipher (conn-slot c cipher)))
                   (cond ((conn-slot cipher interrupted)
                          (let ((ms (engine-handler-timeout-ms (connection-engine c))))
                            (error 'handler-timeout
                                   :seconds (and (plusp ms) (not (conn-slot cipher stop-cut))
                                                 (/ ms 1000.0)))))
                         ((conn-slot cipher timed-out)
                          (setf (conn-slot cipher timed-out) nil)
                          (error 'connection-timeout-error :stream c :operation "TLS read"))
                         (t nil))))))))))

(defun send-to-source (c buffer start end)
  "Write BUFFER[START,END) through C's TLS stream."
  (when (conn-slot c gone)
    (return-from send-to-source))
  (handler-case
      (let ((source (conn-slot c source)))
        (write-sequence buffer source :start start :end end)
        (force-output source)
        (incf (the fixnum (conn-slot c sent)) (- end start)))
    (error (e)
      (setf (conn-slot c gone) t)
      (error 'connection-error :stream c :operation (format nil "TLS write (~A)" e)))))
