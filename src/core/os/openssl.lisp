;;;; openssl.lisp -- TLS on the event loop: OpenSSL (libssl.so.3) through
;;;; SB-ALIEN, on a connection's own non-blocking socket.
;;;;
;;;; These are the few calls the engine makes, on SSL objects known by their
;;;; address (an integer, so a connection slot holds it without boxing); the
;;;; connection's state machine is in http/connection.lisp; tls-io.lisp reads and sends
;;;; through SSL-RECV and SSL-SEND when the connection is TLS.  They answer
;;;; like recv(2) and send(2): a count, 0 at the end of the stream, or -1 and
;;;; an errno, SSL_ERROR_WANT_READ and WANT_WRITE being EAGAIN.  So a TLS
;;;; connection parks in epoll as a plain one does: during the handshake,
;;;; which moves on a step each time bytes arrive (SSL-HANDSHAKE), while a
;;;; request head arrives, between requests, and while the client does not
;;;; read its answer.
;;;;
;;;; Why the calls are shaped as they are:
;;;;  - Edge-triggered epoll: the engine takes a read that returned less than
;;;;    it asked for as "the socket is drained, any later input raises an
;;;;    event".  OpenSSL reads a record at a time and may hold decrypted
;;;;    octets or further records, so SSL-RECV reads until the buffer is full
;;;;    or OpenSSL wants more from the socket: a short count then means the
;;;;    same as on a plain socket, and nothing waits unseen inside OpenSSL.
;;;;    Except the stream's end: a client's close_notify read together with
;;;;    its last request raises no event later (the client may wait for its
;;;;    answer before its FIN), so SSL-RECV says when one came behind the
;;;;    octets it returns.
;;;;  - A write that OpenSSL could not finish must be retried with the same
;;;;    octets.  The engine's output queue retries its front segment
;;;;    unchanged (http/output-queue.lisp), SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER
;;;;    lets those octets move (the garbage collector) in between, and
;;;;    SSL_MODE_ENABLE_PARTIAL_WRITE returns each record written, as send(2)
;;;;    returns a partial count.  A file is read again from the same offset
;;;;    (SSL-SEND-FILE).
;;;;  - SSL_MODE_RELEASE_BUFFERS: an idle connection's SSL object gives its
;;;;    record buffers back, so it costs what the session state costs.
;;;;  - OpenSSL's error queue is per thread and must be empty before a call
;;;;    for SSL_get_error to be right: every failure clears it.
;;;;  - SSL_OP_IGNORE_UNEXPECTED_EOF: a client that closes without
;;;;    close_notify ends the stream (0), as most HTTP clients do, instead of
;;;;    an error per connection.  HTTP's own framing tells a cut answer.
;;;;  - Read-ahead: one read(2) takes what the socket has, where OpenSSL
;;;;    would read each record's header and then its body; what it reads
;;;;    ahead is decrypted by the next SSL_read of the same SSL-RECV.
;;;;  - Renegotiation is refused (SSL_OP_NO_RENEGOTIATION): it would make a
;;;;    read want to write in the middle of a request.
;;;; SIGPIPE is ignored by SBCL's runtime, so OpenSSL's write(2) to a socket
;;;; whose client went away fails with EPIPE instead of killing the process.
;;;;
;;;; The library is loaded when this file loads, if it is there; a server
;;;; without TLS never needs it (MAKE-TLS-CONTEXT says when it is missing).

(in-package #:gallop.core)

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defvar *openssl-loaded*
    (and (ignore-errors (sb-alien:load-shared-object "libcrypto.so.3" :dont-save t))
         (ignore-errors (sb-alien:load-shared-object "libssl.so.3" :dont-save t))
         t)
    "True when libssl.so.3 and libcrypto.so.3 were found and loaded."))

(defconstant +ssl-error-want-read+ 2)
(defconstant +ssl-error-want-write+ 3)
(defconstant +ssl-error-zero-return+ 6) ; any other SSL_get_error: the stream failed

(defconstant +ssl-filetype-pem+ 1)
(defconstant +ssl-ctrl-mode+ 33)
(defconstant +ssl-ctrl-set-read-ahead+ 41)
(defconstant +ssl-mode-enable-partial-write+ #x1)
(defconstant +ssl-mode-accept-moving-write-buffer+ #x2)
(defconstant +ssl-mode-release-buffers+ #x10)
(defconstant +ssl-op-ignore-unexpected-eof+ (ash 1 7))
(defconstant +ssl-op-no-renegotiation+ (ash 1 30))

(defconstant +want-write+ -2
  "Not an errno: SSL-RECV's answer when OpenSSL must write before it can go
on reading (a handshake message the socket did not take).")

(macrolet ((define-ssl-routines (&rest specs)
             `(progn
                ,@(loop for (c-name lisp-name result . arguments) in specs
                        collect `(declaim (inline ,lisp-name))
                        collect `(sb-alien:define-alien-routine (,c-name ,lisp-name) ,result
                                   ,@arguments)))))
  (define-ssl-routines
    ("TLS_server_method" %tls-server-method sb-sys:system-area-pointer)
    ("SSL_CTX_new" %ssl-ctx-new sb-sys:system-area-pointer (method sb-sys:system-area-pointer))
    ("SSL_CTX_free" %ssl-ctx-free sb-alien:void (ctx sb-sys:system-area-pointer))
    ("SSL_CTX_use_certificate_chain_file" %ssl-ctx-use-certificate-chain-file sb-alien:int
     (ctx sb-sys:system-area-pointer) (file sb-alien:c-string))
    ("SSL_CTX_use_PrivateKey_file" %ssl-ctx-use-private-key-file sb-alien:int
     (ctx sb-sys:system-area-pointer) (file sb-alien:c-string) (type sb-alien:int))
    ("SSL_CTX_check_private_key" %ssl-ctx-check-private-key sb-alien:int
     (ctx sb-sys:system-area-pointer))
    ("SSL_CTX_set_default_passwd_cb_userdata" %ssl-ctx-set-default-passwd-cb-userdata sb-alien:void
     (ctx sb-sys:system-area-pointer) (userdata sb-sys:system-area-pointer))
    ("SSL_CTX_ctrl" %ssl-ctx-ctrl sb-alien:long
     (ctx sb-sys:system-area-pointer) (cmd sb-alien:int) (larg sb-alien:long)
     (parg sb-sys:system-area-pointer))
    ("SSL_CTX_set_options" %ssl-ctx-set-options (sb-alien:unsigned 64)
     (ctx sb-sys:system-area-pointer) (options (sb-alien:unsigned 64)))
    ("SSL_new" %ssl-new sb-sys:system-area-pointer (ctx sb-sys:system-area-pointer))
    ("SSL_free" %ssl-free sb-alien:void (ssl sb-sys:system-area-pointer))
    ("SSL_set_fd" %ssl-set-fd sb-alien:int (ssl sb-sys:system-area-pointer) (fd sb-alien:int))
    ("SSL_set_accept_state" %ssl-set-accept-state sb-alien:void (ssl sb-sys:system-area-pointer))
    ("SSL_do_handshake" %ssl-do-handshake sb-alien:int (ssl sb-sys:system-area-pointer))
    ("SSL_read" %ssl-read sb-alien:int
     (ssl sb-sys:system-area-pointer) (buffer sb-sys:system-area-pointer) (count sb-alien:int))
    ("SSL_write" %ssl-write sb-alien:int
     (ssl sb-sys:system-area-pointer) (buffer sb-sys:system-area-pointer) (count sb-alien:int))
    ("SSL_get_error" %ssl-get-error sb-alien:int (ssl sb-sys:system-area-pointer) (ret sb-alien:int))
    ("SSL_shutdown" %ssl-shutdown sb-alien:int (ssl sb-sys:system-area-pointer))
    ("ERR_clear_error" %err-clear-error sb-alien:void)
    ("ERR_get_error" %err-get-error sb-alien:unsigned-long)
    ("ERR_error_string_n" %err-error-string-n sb-alien:void
     (code sb-alien:unsigned-long) (buffer sb-sys:system-area-pointer) (length sb-alien:unsigned-long))
    ("pread" %pread sb-alien:long
     (fd sb-alien:int) (buffer sb-sys:system-area-pointer) (count sb-alien:unsigned-long)
     (offset sb-alien:long))))

;;; Contexts: one per server, made from its certificate and key.

(defstruct (tls-context (:constructor %make-tls-context (address)))
  "An OpenSSL server context (SSL_CTX), by address; 0 once freed."
  (address 0 :type sb-ext:word))

(defmethod print-object ((context tls-context) stream)
  (print-unreadable-object (context stream :type t :identity t)))

(defun openssl-error-text ()
  "OpenSSL's queued errors of this thread, as one string (the queue is left empty)."
  (let ((buffer (make-array 256 :element-type '(unsigned-byte 8) :initial-element 0)))
    (with-output-to-string (out)
      (loop for code = (%err-get-error)
            until (zerop code)
            do (sb-sys:with-pinned-objects (buffer)
                 (%err-error-string-n code (sb-sys:vector-sap buffer) (length buffer)))
               (format out "~:[~;; ~]~A" (plusp (file-position out))
                       (map 'string #'code-char (subseq buffer 0 (position 0 buffer))))))))

(defun make-tls-context (&key certificate-file private-key-file password)
  "An OpenSSL server context for CERTIFICATE-FILE (PEM, the server's
certificate and any chain after it) and PRIVATE-KEY-FILE (PEM; encrypted with
PASSWORD if given).  Free it with FREE-TLS-CONTEXT once no server uses it."
  (unless *openssl-loaded*
    (error "TLS needs OpenSSL 3 (libssl.so.3 and libcrypto.so.3; Debian: libssl3)."))
  (let ((certificate (namestring (truename certificate-file)))
        (key (namestring (truename (or private-key-file certificate-file))))
        (ctx (%ssl-ctx-new (%tls-server-method))))
    (when (zerop (sb-sys:sap-int ctx))
      (error "SSL_CTX_new failed: ~A" (openssl-error-text)))
    (handler-bind ((error (lambda (e) (declare (ignore e)) (%ssl-ctx-free ctx))))
      (%err-clear-error)
      (unless (= 1 (%ssl-ctx-use-certificate-chain-file ctx certificate))
        (error "TLS: cannot use the certificate ~A: ~A" certificate (openssl-error-text)))
      ;; With no password callback, OpenSSL's default one takes the user
      ;; data as the password: set for this one call.
      (let ((secret (and password (sb-alien:make-alien-string password))))
        (unwind-protect
             (progn
               (when secret
                 (%ssl-ctx-set-default-passwd-cb-userdata ctx (sb-alien:alien-sap secret)))
               (unless (= 1 (%ssl-ctx-use-private-key-file ctx key +ssl-filetype-pem+))
                 (error "TLS: cannot use the private key ~A: ~A" key (openssl-error-text))))
          (when secret
            (%ssl-ctx-set-default-passwd-cb-userdata ctx (sb-sys:int-sap 0))
            (sb-alien:free-alien secret))))
      (unless (= 1 (%ssl-ctx-check-private-key ctx))
        (error "TLS: the private key ~A does not match the certificate ~A: ~A"
               key certificate (openssl-error-text)))
      (%ssl-ctx-ctrl ctx +ssl-ctrl-mode+
                     (logior +ssl-mode-enable-partial-write+
                             +ssl-mode-accept-moving-write-buffer+
                             +ssl-mode-release-buffers+)
                     (sb-sys:int-sap 0))
      ;; Read as much as the socket has in one read(2), not each record's
      ;; header and then its body: SSL-RECV reads until OpenSSL wants more
      ;; anyway, so nothing read ahead is left unseen.
      (%ssl-ctx-ctrl ctx +ssl-ctrl-set-read-ahead+ 1 (sb-sys:int-sap 0))
      (%ssl-ctx-set-options ctx (logior +ssl-op-ignore-unexpected-eof+
                                        +ssl-op-no-renegotiation+))
      (%make-tls-context (sb-sys:sap-int ctx)))))

(defun free-tls-context (context)
  "Let go of CONTEXT (OpenSSL keeps it while connections made with it live)."
  (let ((address (shiftf (tls-context-address context) 0)))
    (unless (zerop address)
      (%ssl-ctx-free (sb-sys:int-sap address)))))

;;; One connection's SSL object, by address.

(defun ssl-make (context fd)
  "A new server-side SSL object of CONTEXT on the socket FD, as an address;
0 when OpenSSL could not make one."
  (let ((ssl (%ssl-new (sb-sys:int-sap (tls-context-address context)))))
    (cond ((zerop (sb-sys:sap-int ssl)) (%err-clear-error) 0)
          ((/= 1 (%ssl-set-fd ssl fd)) (%ssl-free ssl) (%err-clear-error) 0)
          (t (%ssl-set-accept-state ssl)
             (sb-sys:sap-int ssl)))))

(defun ssl-free (address)
  (%ssl-free (sb-sys:int-sap address)))

(defun ssl-handshake (address)
  "Move the handshake of the SSL at ADDRESS on as far as the socket allows:
:DONE, :WANT-READ (park until the client sends more), :WANT-WRITE (wait until
the socket takes more), or :FAILED (not TLS, or not a TLS we speak; the
connection is over)."
  (let* ((ssl (sb-sys:int-sap address))
         (result (%ssl-do-handshake ssl)))
    (if (= result 1)
        :done
        (let ((error (%ssl-get-error ssl result)))
          (cond ((= error +ssl-error-want-read+) :want-read)
                ((= error +ssl-error-want-write+) :want-write)
                (t (%err-clear-error) :failed))))))

(declaim (inline ssl-failure))
(defun ssl-failure (ssl result)
  "The errno-like answer for the failed SSL_read or SSL_write RESULT."
  (let ((error (%ssl-get-error ssl result)))
    (cond ((= error +ssl-error-want-read+) +eagain+)
          ((= error +ssl-error-want-write+) +want-write+)
          ((= error +ssl-error-zero-return+) 0)
          (t (%err-clear-error) +econnreset+))))

(defun ssl-recv (address buffer start end)
  "Read plaintext into BUFFER[START,END) from the SSL at ADDRESS (handshake
done) until END or until OpenSSL wants more from the socket.  Returns the
count, 0 at the end of the stream, or -1 and EAGAIN (nothing yet),
+WANT-WRITE+ or ECONNRESET (the stream failed).  A short count means the
socket is drained (see above), unless the third value is true: then the
stream ended right behind the octets read (the client's close_notify, or a
failure), and the next call says so; no event will."
  (declare (type sb-ext:word address) (type octets buffer) (type fixnum start end))
  (let ((ssl (sb-sys:int-sap address))
        (total 0))
    (declare (type fixnum total))
    (sb-sys:with-pinned-objects (buffer)
      (loop
        (let ((n (%ssl-read ssl (sb-sys:sap+ (sb-sys:vector-sap buffer) (+ start total))
                            (- end start total))))
          (declare (type fixnum n))
          (if (plusp n)
              (when (= (incf total n) (- end start))
                (return (values total 0)))
              (let ((answer (ssl-failure ssl n)))
                (return (cond ((plusp total)
                               ;; An end comes again on the next call.
                               (values total 0 (not (or (= answer +eagain+)
                                                        (= answer +want-write+)))))
                              ((zerop answer) (values 0 0))
                              (t (values -1 answer)))))))))))

(defun ssl-send (address buffer start end)
  "Write BUFFER[START,END) through the SSL at ADDRESS.  Returns the count
taken (at least a record's worth, or all), or -1 and EAGAIN (call again
later with the same octets) or ECONNRESET."
  (declare (type sb-ext:word address) (type octets buffer) (type fixnum start end))
  (if (= start end)
      (values 0 0)
      (let ((ssl (sb-sys:int-sap address)))
        (sb-sys:with-pinned-objects (buffer)
          (let ((n (%ssl-write ssl (sb-sys:sap+ (sb-sys:vector-sap buffer) start)
                               (min (- end start) (* 1024 1024 1024)))))
            (declare (type fixnum n))
            (if (plusp n)
                (values n 0)
                (let ((answer (ssl-failure ssl n)))
                  (values -1 (if (or (= answer +want-write+) (= answer +eagain+))
                                 +eagain+
                                 +econnreset+)))))))))

(defun ssl-send-file (address file-fd offset count scratch)
  "Send up to COUNT bytes of the file open on FILE-FD from OFFSET through the
SSL at ADDRESS, read into SCRATCH (octets) first.  As SSL-SEND; 0 when the
file has nothing at OFFSET (it shrank)."
  (declare (type octets scratch) (type fixnum count))
  (let ((want (min count (length scratch))))
    (let ((got (sb-sys:with-pinned-objects (scratch)
                 (loop for n = (%pread file-fd (sb-sys:vector-sap scratch) want offset)
                       until (or (>= n 0) (/= (%errno) +eintr+))
                       finally (return n)))))
      (declare (type fixnum got))
      (cond ((plusp got) (ssl-send address scratch 0 got))
            ((zerop got) (values 0 0))
            (t (values -1 (%errno)))))))

(defun ssl-close-notify (address)
  "Send close_notify on the SSL at ADDRESS (once; no answer awaited)."
  (let ((ssl (sb-sys:int-sap address)))
    (when (minusp (%ssl-shutdown ssl))
      (%err-clear-error))))
