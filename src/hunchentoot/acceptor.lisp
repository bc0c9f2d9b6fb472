;;;; acceptor.lisp -- GALLOP:ACCEPTOR and friends: Hunchentoot's acceptor
;;;; classes running on Gallop's engine.  Change the class name, keep the rest:
;;;;
;;;;   (hunchentoot:start (make-instance 'gallop:easy-acceptor :port 4242))
;;;;
;;;; They take the same initargs as Hunchentoot's classes; :TASKMASTER defaults
;;;; to a GALLOP:TASKMASTER, which then accepts on the listen socket itself.

(in-package #:gallop)

(defgeneric acceptor-access-log-format (acceptor)
  (:documentation "The lines ACCEPTOR's access log gets: :COMBINED or
:HUNCHENTOOT (GALLOP:ACCEPTOR's :ACCESS-LOG-FORMAT; any other acceptor's
are Hunchentoot's, see access-log.lisp).")
  (:method ((acceptor hunchentoot:acceptor))
    :hunchentoot))

(defclass acceptor (hunchentoot:acceptor served-acceptor)
  ((reuse-port :initarg :reuse-port :initform nil :reader acceptor-reuse-port
               :documentation "True: the listen socket is bound with SO_REUSEPORT,
so that several processes that all ask for it serve the same address and
port, the kernel spreading connections across them.")
   (activated-socket :initarg :activated-socket :initform t
                     :reader acceptor-activated-socket
                     :documentation "When a supervisor passed this process
listening sockets (systemd's socket activation: LISTEN_FDS), the acceptor
serves on one of them instead of binding, and its address, port, backlog
and REUSE-PORT are the supervisor's (ACCEPTOR-PORT then reads the passed
socket's port): T takes the one on the acceptor's port (any, when that is
0; START signals an error when none is on it), a string the one of that
name (LISTEN_FDNAMES; an error if it is missing), NIL never takes one.")
   (passed-fd :initform nil
              :documentation "The fd of the copy of a passed socket the acceptor
listens on, until STOP closes it, or NIL.")
   (access-log-format :initarg :access-log-format :initform :combined
                      :reader acceptor-access-log-format
                      :type (member :combined :hunchentoot)
                      :documentation "The lines of the access log
\(:ACCESS-LOG-DESTINATION): :COMBINED, nginx's combined format, what the
client sent escaped as nginx escapes it (access-log.lisp); :HUNCHENTOOT,
Hunchentoot's own lines, byte for byte a stock acceptor's, the client's
fields unescaped (a quote in a User-Agent forges the fields after it)."))
  (:default-initargs
   :taskmaster (make-instance 'taskmaster)
   ;; Connections cost no thread, so let the kernel queue a burst of them
   ;; instead of dropping SYNs (Hunchentoot's default is 50).
   :listen-backlog 1024)
  (:documentation "A Hunchentoot acceptor served by Gallop: an elastic pool of
workers serves requests, and idle connections wait in epoll."))

(defmethod initialize-instance :after ((acceptor acceptor) &key)
  (unless (member (acceptor-access-log-format acceptor) '(:combined :hunchentoot))
    (error "~S: :ACCESS-LOG-FORMAT is ~S, not :COMBINED or :HUNCHENTOOT."
           acceptor (acceptor-access-log-format acceptor))))

(defmethod hunchentoot:start-listening ((acceptor acceptor))
  ;; A socket a supervisor passed, or one bound with SO_REUSEPORT; else
  ;; Hunchentoot's own (usocket's, which also binds IPv6 addresses).
  (when (acceptor-listen-usocket acceptor)
    (hunchentoot:hunchentoot-error "acceptor ~A is already listening" acceptor))
  (let* ((activated (acceptor-activated-socket acceptor))
         (fd (and activated (gallop.core:claim-activated-socket
                             :name (and (stringp activated) activated)
                             :port (hunchentoot:acceptor-port acceptor)
                             :address (hunchentoot:acceptor-address acceptor)))))
    (cond ((or fd (acceptor-reuse-port acceptor) (stringp activated))
           (let ((socket (if fd
                             (gallop.core:socket-of-fd fd)
                             (gallop.core:open-listen-socket
                              (hunchentoot:acceptor-address acceptor)
                              (hunchentoot:acceptor-port acceptor)
                              (hunchentoot:acceptor-listen-backlog acceptor)
                              :reuse-port (acceptor-reuse-port acceptor)
                              :activated activated))))
             (setf (acceptor-listen-usocket acceptor)
                   (make-instance 'usocket:stream-server-usocket
                                  :socket socket :element-type '(unsigned-byte 8)))
             (when fd
               (setf (slot-value acceptor 'passed-fd) fd)
               (set-acceptor-port acceptor (nth-value 1 (sb-bsd-sockets:socket-name socket)))))
           (values))
          (t (call-next-method)))))

(defmethod hunchentoot:stop :after ((acceptor acceptor) &key soft)
  ;; STOP closed the listen socket: a passed one may be taken again.
  (declare (ignore soft))
  (let ((fd (shiftf (slot-value acceptor 'passed-fd) nil)))
    (when fd
      (gallop.core:release-activated-socket fd))))

(defclass easy-acceptor (acceptor hunchentoot:easy-acceptor)
  ()
  (:documentation "Gallop's HUNCHENTOOT:EASY-ACCEPTOR: DEFINE-EASY-HANDLER
handlers and the static file dispatcher, served by Gallop."))

(defclass ssl-acceptor (acceptor hunchentoot:ssl-acceptor)
  ()
  (:documentation "Gallop's HUNCHENTOOT:SSL-ACCEPTOR: the same initargs
\(:SSL-CERTIFICATE-FILE, :SSL-PRIVATEKEY-FILE, :SSL-PRIVATEKEY-PASSWORD).
Gallop's engine speaks TLS itself (OpenSSL on its event loop): the
handshake, request heads and idle keep-alive connections wait in epoll and
hold no thread, as on a plain socket, and handlers read and write
plaintext."))

(defclass easy-ssl-acceptor (easy-acceptor ssl-acceptor hunchentoot:easy-ssl-acceptor)
  ()
  (:documentation "Gallop's HUNCHENTOOT:EASY-SSL-ACCEPTOR."))

(defmethod hunchentoot:handle-request :around ((acceptor acceptor) request)
  ;; Hunchentoot turns handler ERRORs into 500s, but SBCL's control stack
  ;; exhaustion is a STORAGE-CONDITION, and a handler past its deadline gets
  ;; GALLOP:HANDLER-TIMEOUT, another SERIOUS-CONDITION: unwind them here,
  ;; inside the request, and answer 500 or 503 (the connection then closes).
  ;; A stop's cut (no deadline) is logged as one, and answered 503 by the
  ;; engine (NOTE-REQUEST-CUT), unless the engine cannot write on the
  ;; connection (TLS through a library above it): then by Hunchentoot.
  (declare (ignore request))
  (handler-case (call-next-method)
    (handler-timeout (condition)
      (if (gallop.core:handler-timeout-seconds condition)
          (hunchentoot:log-message* :error "~A" condition)
          (note-request-cut acceptor))
      (setf (hunchentoot:return-code*) hunchentoot:+http-service-unavailable+)
      (hunchentoot:abort-request-handler))
    (storage-condition (condition)
      (hunchentoot:log-message* :error "~A" condition)
      (setf (hunchentoot:return-code*) hunchentoot:+http-internal-server-error+)
      (hunchentoot:abort-request-handler))))

(defmethod hunchentoot:handle-request ((hunchentoot:*acceptor* acceptor)
                                       (hunchentoot:*request* hunchentoot:request))
  "Hunchentoot's HANDLE-REQUEST, with the same handlers in the same order
\(the debugger when HUNCHENTOOT:*CATCH-ERRORS-P* is NIL, 400 for
HUNCHENTOOT:BAD-REQUEST, then every ERROR ends the handler and is reported
as a 500), and the backtrace bounded (BOUNDED-BACKTRACE), made only when it
is logged or shown (HUNCHENTOOT:*LOG-LISP-BACKTRACES-P*,
HUNCHENTOOT:*SHOW-LISP-BACKTRACES-P*), for at most the first few errors of
each second (GALLOP.CORE:BACKTRACE-DUE-P), and never for a client that went
away or timed out."
  (handler-bind ((error
                   (lambda (condition)
                     (hunchentoot-handler-done
                      condition
                      (unless (or (client-abort-condition-p condition)
                                  (client-timeout-condition-p condition)
                                  ;; An error page's template may show the
                                  ;; backtrace whenever this is true.
                                  (not (or (and hunchentoot:*log-lisp-errors-p*
                                                hunchentoot:*log-lisp-backtraces-p*)
                                           hunchentoot:*show-lisp-backtraces-p*)))
                        (if (or (null *connection*)
                                (gallop.core:backtrace-due-p
                                 (gallop.core:connection-engine *connection*)))
                            (bounded-backtrace)
                            (format nil "(No backtrace: more than ~D errors in this second.)"
                                    gallop.core:+backtraces-per-second+)))))))
    (handler-bind ((hunchentoot:bad-request
                     (lambda (condition)
                       (declare (ignore condition))
                       (setf (hunchentoot:return-code*) hunchentoot:+http-bad-request+)
                       (hunchentoot:abort-request-handler)))
                   (error #'hunchentoot:maybe-invoke-debugger))
      (hunchentoot:acceptor-dispatch-request hunchentoot:*acceptor* hunchentoot:*request*))))
