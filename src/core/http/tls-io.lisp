;;;; tls-io.lisp -- the engine's own TLS on the event loop: OpenSSL's
;;;; reads and writes on a connection's socket, and the three calls every
;;;; read and send of a connection goes through, on the socket or its TLS.
;;;;
;;;; OpenSSL's calls themselves are os/openssl.lisp's; here is their use on a
;;;; connection: its SSL object, made on the first read (CONNECTION-SSL), the
;;;; handshake a step a read, close_notify and the freeing (END-TLS,
;;;; FREE-TLS).  Invariants: TLS-PHASE only moves forward (:HANDSHAKE, :OPEN,
;;;; :OVER), and a failed call moves it to :OVER (TLS-OUTCOME); one thread
;;;; at a time calls OpenSSL on a connection's SSL object (WITH-SSL); no SSL
;;;; call waits, and the waits for the socket are made outside SSL-LOCK.
;;;; TLS through a library above the engine is tls.lisp's (a plaintext
;;;; connection over this one's octets), not this file's.

(in-package #:gallop.core)

;;; OpenSSL forbids two threads to use one SSL object at once, and on TLS 1.3
;;; SSL_read may write too.  Until it is detached a connection has one owner
;;; at a time (a worker, or the thread answering a suspended request), which
;;; makes its SSL calls without a lock.  A detached or switched stream is
;;; its handler's, and a WebSocket library's threads write frames to it
;;; while its own thread waits in its read (hunchensocket's broadcast): each
;;; SSL call then holds the connection's SSL-LOCK.  The calls never wait
;;; (the socket is non-blocking); the waits for the socket, poll(2), are
;;; made outside the lock, so a reader waiting for its client holds up no
;;; writer.  Closing (END-TLS, FREE-TLS) holds it too, and a call under it
;;; finds no SSL object once freed.  (doc/design.md, "A detached stream's
;;; SSL calls take turns".)

(defmacro with-ssl ((address c) &body body)
  "BODY (one SSL call that does not wait) with ADDRESS bound to the SSL
object of C, whose TLS is open.  With C's SSL-LOCK held if it has one (see
above): then -1 and ECONNRESET, without BODY, when C's TLS ended meanwhile."
  (let ((lock (gensym "LOCK")) (connection (gensym "C")))
    `(let ((,connection ,c))
       (flet ((ssl-call (,address)
                (declare (type sb-ext:word ,address))
                ,@body))
         (declare (inline ssl-call))
         (let ((,lock (conn-slot ,connection ssl-lock)))
           (if ,lock
               (sb-thread:with-mutex (,lock)
                 (if (and (eq (conn-slot ,connection tls-phase) :open)
                          (plusp (the fixnum (conn-slot ,connection tls))))
                     (ssl-call (conn-slot ,connection tls))
                     (values -1 +econnreset+)))
               (ssl-call (connection-ssl ,connection))))))))

(defmacro with-ssl-lock ((c) &body body)
  "BODY, holding C's SSL-LOCK if it has one (see above)."
  (let ((lock (gensym "LOCK")))
    `(flet ((locked () ,@body))
       (declare (dynamic-extent #'locked))
       (let ((,lock (conn-slot ,c ssl-lock)))
         (if ,lock
             (sb-thread:with-mutex (,lock) (locked))
             (locked))))))

;;; Reading and sending on the socket, or through the connection's TLS
;;; (openssl.lisp).  Every read and send of a connection goes through these
;;; three, which answer as recv(2), send(2) and sendfile(2) do (a count, 0 at
;;; the end of the stream, or -1 and an errno), so everything above them is
;;; the same on both.  (A draining connection is read raw: what it sends is
;;; discarded, TLS or not.)  They count the octets read and sent for the
;;; metrics (TALLY-ADD), as does the one send that bypasses them, a raw
;;; connection's blocking send (SEND-ALL).  On the engine's TLS they are the
;;; plaintext's octets (OpenSSL reads and writes the socket itself); through
;;; a TLS library above the engine, the raw connection's, its TLS records.

(declaim (inline connection-recv connection-send))
(defun connection-recv (c buffer start end)
  "Read into BUFFER[START,END) from C without waiting (see above).  On TLS,
the handshake moves on first; a count short of END-START means the socket
is drained, as on a plain socket."
  (counting-octets (c +bytes-in-cell+)
    (if (zerop (the fixnum (conn-slot c tls)))
        (read-into (conn-slot c fd) buffer start end)
        (tls-recv c buffer start end))))

(defun connection-send (c buffer start end)
  "Send BUFFER[START,END) on C without waiting (see above).  On TLS, what
returned EAGAIN must be sent again with the same octets first."
  (counting-octets (c +bytes-out-cell+)
    (if (zerop (the fixnum (conn-slot c tls)))
        (send-from (conn-slot c fd) buffer start end)
        (tls-send c buffer start end))))

(defun connection-send-file-chunk (c file-fd offset count)
  "Send up to COUNT bytes of the file open on FILE-FD from OFFSET on C
without waiting (see above).  TLS reads the file into a buffer first, and on
EAGAIN reads the same octets again the next time."
  (counting-octets (c +bytes-out-cell+)
    (cond ((zerop (the fixnum (conn-slot c tls)))
           (send-file-chunk (conn-slot c fd) file-fd offset (min count (* 1024 1024))))
          ((not (eq (conn-slot c tls-phase) :open)) (values -1 +econnreset+))
          (t (let ((scratch (acquire-buffer)))
               (multiple-value-prog1 (multiple-value-call #'tls-outcome c
                                       (with-ssl (address c)
                                         (ssl-send-file address file-fd offset count scratch)))
                 (release-buffer scratch)))))))

(defun connection-ssl (c)
  "The address of C's SSL object, made now if it is not yet (the first read
is a worker's: a connection that never sends costs no SSL object); 0 when
C's TLS is over or OpenSSL could not make one."
  (with-connection-slots (tls tls-phase fd engine) c
    (cond ((eq tls-phase :over) 0)
          ((plusp tls) tls)
          (t (let ((address (ssl-make (engine-tls engine) fd)))
               ;; A handshake is several small writes in turn (a flight,
               ;; then session tickets, then the answer): Nagle would hold
               ;; each back until the client's delayed ACK, 40 ms.
               (set-nodelay fd)
               (if (zerop address)
                   (progn (setf tls-phase :over) 0)
                   (setf tls address)))))))

(defun tls-outcome (c n errno)
  "Pass on a TLS read's or send's answer; a failure means the TLS stream is
over (no close_notify can follow it)."
  (declare (type fixnum n errno))
  (when (and (minusp n) (/= errno +eagain+))
    (setf (conn-slot c tls-phase) :over))
  (values n errno))

(defun tls-recv (c buffer start end)
  "CONNECTION-RECV on TLS: the handshake, a step a call while it lasts, then
SSL-RECV.  A step that must write waits for the socket (bounded by the write
timeout): a handshake message is a few KiB, which a fresh socket takes."
  (loop
    (if (eq (conn-slot c tls-phase) :open)
        (multiple-value-bind (n errno ended)
            (with-ssl (address c) (ssl-recv address buffer start end))
          (declare (type fixnum n errno))
          (when ended
            ;; The stream's end (the client's close_notify, or a failure)
            ;; came with its last octets, and OpenSSL has read it: the
            ;; socket may raise no further event (a client that waits for
            ;; its answer before its FIN), so the short count must not
            ;; park C as drained.
            (setf (conn-slot c peer-closed) t))
          ;; The wait, if any, outside WITH-SSL.
          (if (and (minusp n) (= errno +want-write+))
              (unless (wait-for-socket c +pollout+ "TLS write")
                (return (tls-outcome c -1 +econnreset+)))
              (return (tls-outcome c n errno))))
        (let ((address (connection-ssl c)))
          (when (zerop address)
            (return (values -1 +econnreset+)))
          (ecase (ssl-handshake address)
            (:done (setf (conn-slot c tls-phase) :open)
             (tally-add c +tls-handshakes-cell+ 1))
            (:want-read
             ;; The handshake counts as part of the first request's head:
             ;; the header timeout bounds both (see PARK).
             (unless (conn-slot c head-started)
               (setf (conn-slot c head-started) (now-ms)))
             (return (values -1 +eagain+)))
            (:want-write
             (unless (wait-for-socket c +pollout+ "TLS handshake")
               (return (tls-outcome c -1 +econnreset+))))
            (:failed (return (tls-outcome c -1 +econnreset+))))))))

(defun wait-for-socket (c events operation)
  "Wait (bounded by the write timeout) until C's socket is ready for EVENTS;
NIL when it timed out."
  (handler-case (progn (wait-for-fd c events (engine-write-timeout-ms (connection-engine c))
                                    operation)
                       t)
    (connection-error () nil)))

(defun tls-send (c buffer start end)
  "CONNECTION-SEND on TLS: nothing goes out before the handshake is done."
  (if (eq (conn-slot c tls-phase) :open)
      (multiple-value-call #'tls-outcome c
        (with-ssl (address c) (ssl-send address buffer start end)))
      (values -1 +econnreset+)))

(defun connection-tls-p (c)
  "True when C speaks TLS on the engine's own event loop (openssl.lisp)."
  (/= 0 (the fixnum (conn-slot c tls))))

(defun tls-handshaking-p (c)
  "True while C's TLS handshake is not done."
  (and (/= 0 (the fixnum (conn-slot c tls))) (eq (conn-slot c tls-phase) :handshake)))

(defun end-tls (c)
  "C's TLS, if any, is over: send close_notify first if it is open (one
non-blocking send).  The SSL object stays until CLOSE-CONNECTION frees it."
  (unless (zerop (the fixnum (conn-slot c tls)))
    (with-ssl-lock (c)
      (when (and (eq (conn-slot c tls-phase) :open) (plusp (conn-slot c tls)))
        (ssl-close-notify (conn-slot c tls)))
      (setf (conn-slot c tls-phase) :over))))

(defun free-tls (c)
  "Free C's SSL object (C is closing), after its close_notify when still open."
  (unless (zerop (the fixnum (conn-slot c tls)))
    (end-tls c)
    (with-ssl-lock (c)
      (when (plusp (conn-slot c tls))
        (ssl-free (conn-slot c tls))
        (sb-ext:atomic-incf (engine-tls-freed (connection-engine c))))
      (setf (conn-slot c tls) -1))))
