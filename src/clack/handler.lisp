;;;; handler.lisp -- the Clack handler: what (clack:clackup app :server :gallop)
;;;; calls.  Clack calls RUN with the app and its options; RUN serves until its
;;;; thread is destroyed (Clack's STOP does that when :USE-THREAD is true) or
;;;; interrupted, and then stops the server, joining every thread it started.

(defpackage #:clack.handler.gallop
  (:use #:common-lisp)
  (:export #:run))
(in-package #:clack.handler.gallop)

(defparameter *clack-tls-options*
  '((:ssl-cert-file . :ssl-certificate-file)
    (:ssl-key-file . :ssl-privatekey-file)
    (:ssl-key-password . :ssl-privatekey-password))
  "Clack's names for the TLS options (clackup :SSL T ...), and START's.")

(defun start-options (options)
  "The options of the property list OPTIONS that GALLOP:START accepts, in
their order (so the first of a repeated key still wins), Clack's names of
the TLS options read as START's.  Clack's own options (:SERVER, :USE-THREAD,
:USE-DEFAULT-MIDDLEWARES, :SILENT, :SSL, :ALLOW-OTHER-KEYS ...) and any
other key are left out."
  (loop for (clack-key value) on options by #'cddr
        for key = (or (cdr (assoc clack-key *clack-tls-options*)) clack-key)
        when (member key gallop::+start-keywords+)
          append (list key value)))

(defun run (app &rest options &key &allow-other-keys)
  "Serve the Clack APP with Gallop until this thread is destroyed or
interrupted.  Every option GALLOP:START accepts is passed to it (:ADDRESS,
:PORT, :DEBUG, :MAX-THREAD-COUNT, :MAX-HEAD-BYTES, :HEADER-TIMEOUT ...,
with START's defaults for the ones not given); the others are Clack's own
and are ignored."
  (let ((server (apply #'gallop:start app (start-options options)))
        (forever (sb-thread:make-semaphore :name "clack.handler.gallop")))
    (unwind-protect
         (loop (sb-thread:wait-on-semaphore forever))
      (gallop:stop server))))

;;; Clack's socket protocol (CLACK.SOCKET), on the environment's :CLACK.IO:
;;; the request's connection, which the app takes as a socket when it
;;; switches protocols (websocket-driver does).  Asynchronous: the read
;;; callback is called on a pool worker as octets arrive, writes never wait.

(defmethod clack.socket:read-callback ((socket gallop::exchange))
  (gallop:socket-read-callback socket))

(defmethod (setf clack.socket:read-callback) (callback (socket gallop::exchange))
  (setf (gallop:socket-read-callback socket) callback))

(defmethod clack.socket:write-sequence-to-socket ((socket gallop::exchange) data &key callback)
  ;; CALLBACK once the octets are queued, in order: the client gets them
  ;; before anything written after.
  (when (and (gallop:socket-write socket data) callback)
    (funcall callback)))

(defmethod clack.socket:write-sequence-to-socket-buffer ((socket gallop::exchange) data)
  ;; Writes go out when the worker owning the connection next sends: one
  ;; buffer already, for what is written in a row.
  (gallop:socket-write socket data))

(defmethod clack.socket:flush-socket-buffer ((socket gallop::exchange) &key callback)
  (when callback (funcall callback)))

(defmethod clack.socket:close-socket ((socket gallop::exchange))
  (gallop:socket-close socket))

(defmethod clack.socket:socket-async-p ((socket gallop::exchange))
  t)
