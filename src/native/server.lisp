;;;; server.lisp -- the native app API, in the Clack convention:
;;;;
;;;;   (gallop:start (lambda (env) '(200 (:content-type "text/plain") ("Hey!")))
;;;;                 :address "127.0.0.1" :port 4242)
;;;;
;;;; An app is a function of the environment (see MAKE-ENV) that returns
;;;; (STATUS HEADERS BODY), BODY being a list of strings or octet vectors, an
;;;; octet vector, or a pathname (sent with sendfile); or that returns a
;;;; function of one argument, a responder, for delayed and streaming
;;;; responses.  The responder may be called from any thread: with (STATUS
;;;; HEADERS BODY) it answers; with (STATUS HEADERS) it returns a writer,
;;;; (lambda (data &key close)), that streams the body in chunks.  Both
;;;; return quietly when the client is gone: the responder answers NIL
;;;; instead of T, the writer NIL from then on, nothing is logged.
;;;;
;;;; The app runs in the pool worker that read the request: a fast app pays no
;;;; thread hand-off, and an app that blocks holds only its own worker while
;;;; the pool grows around it.

(in-package #:gallop)

(declaim (inline accepting-p))
(defun accepting-p (server)
  "True unless SERVER is stopping: then responses say Connection: close."
  (let ((engine (server-engine server)))
    (and engine (gallop.core:engine-running-p engine))))

(defun respond (ex status headers body)
  "Write a complete response for EX."
  (let* ((c (exchange-connection ex))
         (status (if (integerp status) status 500))
         (keep-alive (and (exchange-keep-alive ex)
                          (accepting-p (exchange-server ex))
                          (not (connection-token-p (header-value headers :connection) "close"))))
         (log (exchange-access-log ex))
         (sent 0))
    (declare (type fixnum sent))
    (setf (exchange-keep-alive ex) keep-alive
          (exchange-responded ex) t)
    ;; The access log's line, whether or not the client took the answer.
    (unwind-protect
         (cond
           ((or (pathnamep body) (and (consp body) (eq (car body) :file)))
            (let ((path (if (pathnamep body) body (second body))))
              (with-open-file (file path :element-type '(unsigned-byte 8))
                (let ((size (file-length file)))
                  (write-head c status headers :content-length size :keep-alive keep-alive
                                               :http-1.0 (exchange-http-1.0 ex))
                  (unless (exchange-head-p ex)
                    (setf sent size)
                    (gallop.core:connection-send-file c (sb-sys:fd-stream-fd file) 0 size))))))
           ((and (consp body) (null (cdr body)) (simple-ascii-string-p (car body)))
            ;; The common case, one ASCII string: no UTF-8 encoding, no copy.
            (let ((string (car body))
                  (no-body (no-body-status-p status)))
              (unless (or no-body (exchange-head-p ex))
                (setf sent (length string)))
              (%write-head c status headers (unless no-body (length string)) nil
                           keep-alive (exchange-http-1.0 ex)
                           (unless (or no-body (exchange-head-p ex)) string))))
           (t
            (let* ((chunks (cond ((null body) '())
                                 ((and (consp body) (null (cdr body))) (list (body-octets (car body))))
                                 ((listp body) (mapcar #'body-octets body))
                                 (t (list (body-octets body)))))
                   (length (loop for chunk in chunks sum (length (the octets chunk)))))
              (write-head c status headers
                          :content-length (unless (no-body-status-p status) length)
                          :keep-alive keep-alive :http-1.0 (exchange-http-1.0 ex))
              (unless (or (exchange-head-p ex) (no-body-status-p status))
                (setf sent length)
                ;; The body is the app's to give up (doc/native-api.md): what the client does
                ;; not read at once waits as it is, not copied.
                (dolist (chunk chunks)
                  (gallop.core:connection-write-octets c chunk 0 (length chunk) :reference))))))
      (when log
        (log-access log ex status sent)))
    (gallop.core:connection-flush c)))

(defun complete (ex)
  "The response of EX is finished.  If the worker already left (the app
answered from another thread), finish the connection from this thread.
Not called by a thread that has EX :RESPONDING (see UNCLAIM): one that
finds it so waits until its writer is done."
  (loop
    (case (exchange-state ex)
      (:open
       (when (eq :open (sb-ext:compare-and-swap (exchange-state ex) :open :done))
         (return)))
      (:responding (sb-thread:thread-yield))
      (:suspended
       (setf (exchange-state ex) :done)
       (gallop.core:connection-resume (exchange-connection ex) (exchange-keep-alive ex))
       (return))
      (:done (return)))))

;;; Who writes on the connection.  While the app runs, the worker owns the
;;; connection (EXCHANGE-STATE :OPEN); once the app has returned without an
;;; answer, the worker hands it over to the engine (:SUSPENDED, parked in
;;; epoll), and a thread answering later takes it from the engine for each
;;; write (GALLOP.CORE:CONNECTION-ACQUIRE, -RELEASE, -RESUME).  A thread
;;; that answers while the state is still :OPEN (from the app itself, or
;;; from another thread before the worker handed over) writes in place, and
;;; marks the exchange :RESPONDING meanwhile, so that the worker cannot hand
;;; the connection over in the middle of that write: it waits for :OPEN or
;;; :DONE again.  Without that mark, a thread that saw :OPEN and wrote
;;; could find the exchange :SUSPENDED by the time it finished, and resume
;;; a connection it never acquired (the engine had parked it): the answer
;;; arrived, then the connection closed before the next request.

(defun claim (ex)
  "Before a write on EX's connection, from any thread: :DIRECT when the
worker has not handed the connection over (EX is now :RESPONDING),
:ACQUIRED when it had and CONNECTION-ACQUIRE took it back, NIL when there
is nothing to write to (the client went away, or EX is done).  Give it back
with UNCLAIM."
  (loop
    (case (exchange-state ex)
      (:open
       (when (eq :open (sb-ext:compare-and-swap (exchange-state ex) :open :responding))
         (return :direct)))
      (:responding (sb-thread:thread-yield)) ; another writer: wait for it
      (:suspended
       (return (and (gallop.core:connection-acquire (exchange-connection ex)) :acquired)))
      (:done (return nil)))))

(defmacro with-claim ((claim ex) &body body)
  "Run BODY with CLAIM bound to (CLAIM EX); BODY ends with UNCLAIM.  Should
BODY be left by a non-local exit (a handler deadline interrupts a write, a
condition that is not an ERROR), a :DIRECT claim goes back to :OPEN, so that
the worker's own error handling finishes the exchange."
  (let ((done (gensym "DONE")) (exchange (gensym "EX")))
    `(let* ((,exchange ,ex)
            (,claim (claim ,exchange))
            (,done nil))
       (unwind-protect (multiple-value-prog1 (progn ,@body) (setf ,done t))
         (when (and (not ,done) (eq ,claim :direct)
                    (eq (exchange-state ,exchange) :responding))
           (setf (exchange-state ,exchange) :open))))))

(defun unclaim (ex claim last)
  "After a write under CLAIM (what CLAIM returned): when LAST (the response
is finished, or failed), finish it; else give the connection back."
  (case claim
    (:direct (setf (exchange-state ex) (if last :done :open)))
    (:acquired (if last
                   (complete ex)
                   (gallop.core:connection-release (exchange-connection ex))))
    ((nil) (when last (complete ex)))))

(defun start-streaming (ex status headers)
  "Write the head of a streamed response; return the writer.  An answer to
HEAD, or one whose status has no body, is its head alone: the writer sends
none of the data it is given, and the connection stays open as after any
answer.  Another body without a Content-Length is chunked, or on HTTP/1.0
delimited by the connection's end."
  (let* ((c (exchange-connection ex))
         (length (header-value headers :content-length))
         (bodiless (or (exchange-head-p ex) (no-body-status-p status)))
         (chunked (and (not length) (not (exchange-http-1.0 ex)) (not bodiless)))
         (keep-alive (and (exchange-keep-alive ex) (or length chunked bodiless)
                          (accepting-p (exchange-server ex))
                          (not (connection-token-p (header-value headers :connection) "close"))))
         (closed nil)
         (gone nil))                    ; a write found the client gone
    (setf (exchange-keep-alive ex) keep-alive
          (exchange-responded ex) t
          (exchange-streaming ex) t)
    (let ((log (exchange-access-log ex)))
      (when log
        (log-access log ex status
                    (cond (bodiless 0)
                          (length (ignore-errors (parse-integer length)))))))
    (flet ((send (write last)
             ;; Call WRITE (it writes on C) with C claimed (CLAIM), then
             ;; finish the response when LAST or when it failed.
             (with-claim (claim ex)
               (if (null claim)
                   (setf closed t       ; the client went away meanwhile
                         gone t
                         (exchange-keep-alive ex) nil)
                   (handler-case (funcall write)
                     (error (e)
                       (setf closed t
                             gone t
                             (exchange-keep-alive ex) nil)
                       (unless (client-gone-p (exchange-server ex) e)
                         (log-failure (exchange-server ex) e "Streaming to ~A failed: ~A" c e)))))
               (cond ((or closed last)
                      (setf closed t)
                      (unclaim ex claim t))
                     (t (unclaim ex claim nil))))))
      (send (lambda ()
              (write-head c status headers :chunked chunked :keep-alive keep-alive
                                           :http-1.0 (exchange-http-1.0 ex))
              (gallop.core:connection-flush c))
            nil)
      (lambda (data &key close)
        (unless closed
          (send (lambda ()
                  (when (and data (not bodiless))
                    (let ((octets (body-octets data)))
                      (if chunked
                          (write-chunk c octets)
                          (gallop.core:connection-write-octets c octets))))
                  (when (and close chunked)
                    (gallop.core:connection-write-octets c +last-chunk+))
                  (gallop.core:connection-flush c))
                close))
        ;; True while the client takes what it is sent: a streamer (an
        ;; event source) drops a writer that answers NIL.
        (not gone)))))

(defun make-responder (ex)
  (lambda (response)
    (destructuring-bind (status headers &optional (body nil body-p)) response
      (cond ((exchange-responded ex)
             (error "This request was already answered."))
            (body-p
             (with-claim (claim ex)
               (let ((delivered t))
                 (if (null claim)
                     (setf delivered nil
                           (exchange-responded ex) t ; the client went away meanwhile
                           (exchange-keep-alive ex) nil)
                     (handler-case (respond ex status headers body)
                       (error (e)
                         (setf delivered nil
                               (exchange-keep-alive ex) nil)
                         (unless (client-gone-p (exchange-server ex) e)
                           (log-failure (exchange-server ex) e "Responding failed: ~A" e)))))
                 (unclaim ex claim t)
                 delivered)))
            (t (start-streaming ex status headers))))))

(defun client-gone-p (server condition)
  "True (and counted) when CONDITION means the client went away: not worth a
log line, and nobody to answer."
  (when (and (typep condition 'gallop.core:connection-error)
             (not (typep condition 'gallop.core:connection-timeout-error)))
    (let ((engine (server-engine server)))
      (when engine (gallop.core:note-client-abort engine)))
    t))

(defun note-exchange-cut (server ex env)
  "A stop cut the request of EX, whose environment is ENV (its handler was
interrupted, see the core's CUT-REQUESTS): log its line, once; and unless
the app answered, the 503 the engine writes for it (the core's RUN-HANDLER)
in the access log."
  (let* ((uri (getf env :request-uri))
         (line (gallop.core:stop-cut-message
                (exchange-connection ex) (getf env :request-method)
                (and (stringp uri) (subseq uri 0 (position #\? uri)))
                (getf env :remote-addr) (getf env :remote-port)))
         (log (exchange-access-log ex)))
    (when line
      (log-error server "~A" line))
    (when (and log (not (exchange-responded ex)))
      (log-access log ex 503 (gallop.core:error-body-bytes 503)))))

(defun internal-error (server ex condition &optional env)
  "The app failed with CONDITION: log it once, answer 500 (503 when it ran
past its deadline; 400 or 413 when it was the client's body, not logged)
unless it already answered.  The connection closes after it, but for a 500
written whole: the engine then goes on with the connection as after any
answer (the rest of an unread body skipped, or the connection closed).  A
stop's cut (HANDLER-TIMEOUT with no deadline) is NOTE-EXCHANGE-CUT's, with ENV,
the request's environment: the engine itself answers it 503, with the same
octets on both front ends."
  (let ((timeout (typep condition 'handler-timeout))
        (body-status (and (typep condition 'gallop.core:request-body-error)
                          (gallop.core:request-body-error-status condition))))
    (when (and timeout (null (gallop.core:handler-timeout-seconds condition)))
      (setf (exchange-keep-alive ex) nil)
      (note-exchange-cut server ex env)
      (return-from internal-error))
    (when (typep condition 'gallop.core:overloaded)
      ;; Short of memory, the server takes no new upgrade (overload.lisp):
      ;; not the app's error, and not logged as one.
      (setf (exchange-keep-alive ex) nil)
      (unless (exchange-responded ex)
        (ignore-errors
         (respond ex 503 (list :content-type "text/plain; charset=utf-8"
                               :retry-after (princ-to-string
                                             (gallop.core:engine-retry-after
                                              (gallop.core:connection-engine
                                               (exchange-connection ex)))))
                  (list (format nil "503 Service Unavailable~%")))))
      (return-from internal-error))
    (when (or timeout body-status (exchange-responded ex))
      (setf (exchange-keep-alive ex) nil))
    (when (client-gone-p server condition)
      (setf (exchange-keep-alive ex) nil)
      (return-from internal-error))
    (if body-status
        (unless (exchange-responded ex)
          (ignore-errors
           (respond ex body-status '(:content-type "text/plain; charset=utf-8")
                    (list (format nil "~D ~A~%" body-status
                                  (gallop.core:reason-phrase body-status))))))
        (progn
          (log-failure server condition "~:[Error in app~;App interrupted~]: ~A" timeout condition)
          (unless (exchange-responded ex)
            (handler-case
                (respond ex (if timeout 503 500) '(:content-type "text/plain; charset=utf-8")
                         (cond ((server-debug server)
                                (list (format nil "~:[Internal Server Error~;Service Unavailable~]~%~%~A~%"
                                              timeout condition)))
                               (timeout '("Service Unavailable"))
                               (t '("Internal Server Error"))))
              (error ()
                (setf (exchange-keep-alive ex) nil))))))))

(defvar *empty-body* (make-octet-input-stream (make-array 0 :element-type '(unsigned-byte 8)))
  "The :RAW-BODY of every request without a body: always at end of file, so
threads can share it.")

(defun serve-request (server c)
  "The engine's handler: build the environment, read the body, run the app,
write its response, and return what becomes of C (:KEEP-ALIVE, :CLOSE or
:SUSPENDED, see GALLOP.CORE:MAKE-ENGINE)."
  (multiple-value-bind (env keep-alive http-1.0 expect-continue agent referer authorization)
      (make-env server c)
    (let ((ex (make-exchange c server keep-alive http-1.0
                             (eq (gallop.core:request-method (gallop.core:connection-request c))
                                 :head))))
      (gallop.core:connection-consume-head c)
      ;; The body is read as the app reads :RAW-BODY (the engine's BODY-STREAM,
      ;; which answers 100 Continue on its first read when the client asked).
      ;; In front: no walk down the property list.
      (setf env (list* :raw-body (if (gallop.core:connection-body-pending-p c)
                                     (gallop.core:make-body-stream c :continue expect-continue)
                                     *empty-body*)
                       :clack.io ex     ; the connection as a socket (socket.lisp)
                       env))
      (let ((log (server-access-log server)))
        (when log
          (setf (exchange-access-log ex) log
                (exchange-agent ex) agent
                (exchange-referer ex) referer
                (exchange-authorization ex) authorization)
          (loop for (key value) on env by #'cddr
                do (case key
                     (:remote-addr (setf (exchange-address ex) value))
                     (:request-method (setf (exchange-method ex) value))
                     (:request-uri (setf (exchange-uri ex) value))
                     (:server-protocol (setf (exchange-protocol ex) value))))))
      (let ((response (handler-case (funcall (server-app server) env)
                        (serious-condition (e)
                          (internal-error server ex e env)
                          (complete ex)
                          :failed))))
        (cond ((eq response :failed))   ; answered (or not: the client left)
              ((functionp response)
               (handler-case (funcall response (make-responder ex))
                 (serious-condition (e) (internal-error server ex e env) (complete ex))))
              ((gallop.core:connection-upgraded-p c)) ; the app took it as a socket
              ((consp response)
               ;; (status headers &optional body), taken apart by hand:
               ;; DESTRUCTURING-BIND's checks cost more than the rest here.
               (handler-case (if (and (consp (cdr response))
                                      (listp (cddr response))
                                      (null (cdddr response)))
                                 (respond ex (car response) (cadr response) (caddr response))
                                 (error "The app's response ~A is not (status headers [body])."
                                        ;; Printed now, and short: it may be huge or circular.
                                        (let ((*print-length* 4) (*print-level* 2)
                                              (*print-circle* t) (*print-readably* nil))
                                          (prin1-to-string response))))
                 (serious-condition (e) (internal-error server ex e env)))
               (complete ex))
              ((not (exchange-responded ex))
               (internal-error server ex "the app returned no response")
               (complete ex))))
      (loop
        (case (exchange-state ex)
          (:done
           ;; Answered (the common case): nothing to hand over.
           (return (if (exchange-keep-alive ex) :keep-alive :close)))
          (:responding
           ;; Another thread writes in place (CLAIM): not in mid-write.
           (sb-thread:thread-yield))
          (t
           (when (gallop.core:connection-upgraded-p c)
             ;; The app took the connection as a socket (socket.lisp): it is
             ;; the engine's from here on (upgrade.lisp), not HTTP.
             (setf (exchange-state ex) :done)
             (return :keep-alive))
           ;; Still open: the app answers later from another thread.
           (gallop.core:connection-suspend c)
           (when (eq :open (sb-ext:compare-and-swap (exchange-state ex) :open :suspended))
             (return :suspended))
           ;; Answered, or being answered, meanwhile: look again.
           (gallop.core:connection-unsuspend c)))))))

;;; Starting and stopping

(defun close-listen-socket (socket)
  "Close a server's listening SOCKET; if it was a copy of a socket a
supervisor passed, the next server may take that one."
  (let ((fd (sb-bsd-sockets:socket-file-descriptor socket)))
    (sb-bsd-sockets:socket-close socket)
    (gallop.core:release-activated-socket fd)))

(defun passed-socket-address (socket)
  "The address a listening SOCKET a supervisor passed is bound to, as a
string: dotted for IPv4, eight groups of hex digits for IPv6."
  (let ((bound (sb-bsd-sockets:socket-name socket)))
    (if (= 4 (length bound))
        (format nil "~{~D~^.~}" (coerce bound 'list))
        (format nil "~{~(~2,'0x~2,'0x~)~^:~}" (coerce bound 'list)))))

(sb-int:defconstant-eqx +start-keywords+
    (append '(:address :port :backlog :debug :log :reuse-port :activated-socket
              :access-log :access-log-format
              :ssl-certificate-file :ssl-privatekey-file :ssl-privatekey-password)
            (loop for (setting) in gallop.core:+settings+
                  collect (intern (symbol-name setting) :keyword)))
  #'equal
  "The keywords START accepts, in the order of its lambda list: its own, then
one per setting (GALLOP.CORE:+SETTINGS+).  The Clack handler passes these on
from clackup.  A key added to START's own is added here too: a test compares
this list with START's lambda list.")

(gallop.core:define-settings-function start (app)
    ((address "127.0.0.1") (port 5000) (backlog 1024) debug (log *error-output*)
     reuse-port (activated-socket t) access-log (access-log-format :combined)
     ssl-certificate-file ssl-privatekey-file ssl-privatekey-password)
  "Serve APP, a function of a Clack environment, on ADDRESS:PORT (port 0: any
free port, see SERVER-PORT).  Returns the running server; GALLOP:STOP stops
it.  The other keywords are the settings every Gallop server takes, with
their defaults (the table +SETTINGS+ of src/core/settings.lisp): APP runs in
an elastic pool of MAX-THREAD-COUNT workers, keeping STANDBY-THREAD-COUNT
when idle; timeouts are in seconds.  Errors in APP are logged to LOG and answered with
500 (with the error text when DEBUG is true).  HANDLER-TIMEOUT (seconds, none
by default) bounds how long APP may run on one request in its worker: past
it, GALLOP:HANDLER-TIMEOUT is signalled in APP's thread, the client gets 503
and the connection is closed.  A delayed response (APP returned a function)
is bounded only while that function runs in the worker.
With SSL-CERTIFICATE-FILE (PEM: the certificate, then any chain) and
SSL-PRIVATEKEY-FILE (PEM; default: the certificate file; encrypted with
SSL-PRIVATEKEY-PASSWORD if given), SERVER speaks HTTPS only (OpenSSL on the
event loop: a TLS connection waits in epoll as a plain one does), and the
environment's :URL-SCHEME is \"https\".
With REUSE-PORT true, the socket is bound with SO_REUSEPORT: several
processes that all ask for it may serve the same ADDRESS and PORT, the
kernel spreading connections across them.  When a supervisor passed this
process listening sockets (systemd's socket activation: LISTEN_FDS), the
server serves on one of them instead of binding, and ADDRESS, PORT, BACKLOG
and REUSE-PORT are the supervisor's: ACTIVATED-SOCKET T (the default) takes
the one on PORT (any, when PORT is 0; an error when none is on PORT), a
string the one of that name (LISTEN_FDNAMES, an error if it is missing),
NIL never takes one.
ACCESS-LOG, a file (appended to) or a stream, gets a line per answer
\(the engine's own refusals, 408s and 503s included) in ACCESS-LOG-FORMAT:
:COMBINED (nginx's and Apache's) or :JSON (one object a line); see
access-log.lisp."
  (check-type app function)
  (let ((access-log (and access-log (open-access-log access-log access-log-format))))
    (handler-bind ((error (lambda (e) (declare (ignore e))
                            (when access-log (close-access-log access-log)))))
      (start-listening app address port backlog debug log reuse-port activated-socket
                       access-log ssl-certificate-file ssl-privatekey-file
                       ssl-privatekey-password
                       (gallop.core:setting-arguments)))))

(defun start-listening (app address port backlog debug log reuse-port activated-socket
                        access-log ssl-certificate-file ssl-privatekey-file
                        ssl-privatekey-password settings)
  "GALLOP:START's work once its access log is open (ACCESS-LOG, or NIL), the
engine made with SETTINGS (its keyword arguments)."
  (let ((tls (and ssl-certificate-file
                  (gallop.core:make-tls-context :certificate-file ssl-certificate-file
                                                :private-key-file ssl-privatekey-file
                                                :password ssl-privatekey-password))))
    (multiple-value-bind (socket passed)
        (handler-bind ((error (lambda (e) (declare (ignore e))
                                (when tls (gallop.core:free-tls-context tls)))))
          (gallop.core:open-listen-socket address port backlog
                                          :reuse-port reuse-port :activated activated-socket))
      (let ((server (%make-server :app app :socket socket
                                  :address (if passed
                                               (passed-socket-address socket)
                                               (or address "0.0.0.0"))
                                  :port (nth-value 1 (sb-bsd-sockets:socket-name socket))
                                  :max-body-bytes (getf settings :max-body-bytes)
                                  :debug debug :log log
                                  :tls tls :url-scheme (if tls "https" "http"))))
        (handler-bind ((error (lambda (e) (declare (ignore e))
                                (close-listen-socket socket)
                                (when tls (gallop.core:free-tls-context tls)))))
          (let ((engine (apply #'gallop.core:make-engine
                               :name (format nil "gallop-~D" (server-port server))
                               :tls-context tls
                               :handler (lambda (c) (serve-request server c))
                               :log-error (lambda (format-control &rest args)
                                            (apply #'log-error server format-control args))
                               ;; The answers the engine writes itself.
                               :log-answer (and access-log
                                                (lambda (c status bytes buffer start end)
                                                  (log-engine-answer access-log c status bytes
                                                                     buffer start end)))
                               settings)))
            (setf (server-engine server) engine
                  (server-access-log server) access-log)
            (gallop.core:engine-start engine
                                      :listen-fd (sb-bsd-sockets:socket-file-descriptor socket)
                                      :own-listener (not passed))))
        (note-running server t)
        server))))

(defun stop (server &key soft)
  "Stop SERVER: stop accepting, close idle connections, join every thread,
and free the port.  SOFT: a graceful stop, within the STOP-TIMEOUT setting
\(then the rest is cut): the connections waiting on the listen socket are
accepted and served before it is shut (unless a supervisor passed it: then
they wait for the next process); idle keep-alive connections are kept for
STOP-IDLE-GRACE; every request that arrives meanwhile is answered with
Connection: close; requests in flight finish."
  (note-running server nil)
  (when (server-engine server)
    (gallop.core:engine-stop (server-engine server) :soft soft)
    (setf (server-engine server) nil))
  (when (server-socket server)
    (close-listen-socket (shiftf (server-socket server) nil)))
  (when (server-tls server)
    (gallop.core:free-tls-context (shiftf (server-tls server) nil)))
  (when (server-access-log server)
    (close-access-log (shiftf (server-access-log server) nil)))
  server)

;;; Timers

(defgeneric server-pool (server)
  (:documentation "The worker pool of SERVER (a running GALLOP:START server, or
a Hunchentoot acceptor or GALLOP:TASKMASTER on Gallop), whose workers run
its timers; NIL when it is not running.")
  (:method ((server server))
    (let ((engine (server-engine server)))
      (and engine (gallop.core:engine-pool engine)))))

(defun after (seconds thunk &key server)
  "Call THUNK with no arguments on a worker of SERVER's pool once SECONDS (a
non-negative real; resolution: the kernel's timer, well under a millisecond)
have passed, and return a timer for GALLOP:CANCEL-TIMER.  No thread waits
meanwhile: a pending timer is a heap entry (timers.lisp), so a request
answered later by a timer costs memory, not a thread.  In a handler, a
native app or another timer's thunk (any worker of a Gallop server) SERVER
may be left out: the server of that worker.  THUNK runs as a handler does:
an error in it is logged and goes no further; a THUNK that blocks holds its
worker, and the pool grows around it.  Timers still pending when the server
stops are dropped."
  (let ((pool (cond (server (or (server-pool server)
                                (error "GALLOP:AFTER: ~A is not running." server)))
                    (gallop.core:*worker-pool*)
                    (t (error "GALLOP:AFTER outside a Gallop worker needs :SERVER.")))))
    (gallop.core:schedule-timer pool seconds thunk)))

(defun cancel-timer (timer)
  "Cancel TIMER (from GALLOP:AFTER) if its thunk has not run yet: true if it
was pending; NIL when it already ran, is running or was cancelled."
  (gallop.core:cancel-timer timer))

(defgeneric stats (thing)
  (:documentation "Connection and pool statistics of a running Gallop server,
acceptor or taskmaster, as a property list (see GALLOP.CORE:ENGINE-STATS), or
NIL when it is not running."))

(defmethod stats ((server server))
  (let ((engine (server-engine server))
        (log (server-access-log server)))
    (and engine (append (gallop.core:engine-stats engine)
                        (and log (access-log-stats log))))))
