;;;; taskmaster.lisp -- GALLOP:TASKMASTER, a Hunchentoot taskmaster on
;;;; Gallop's engine.
;;;;
;;;; A worker serves a request, not a connection's whole life: between
;;;; keep-alive requests the connection waits in epoll and holds no thread.
;;;; This works through Hunchentoot's PROCESS-CONNECTION (its request loop,
;;;; run by Gallop's SERVE-REQUESTS on a Gallop connection, request-loop.lisp):
;;;; the stream it reads is a Gallop connection, and after each response
;;;; RESET-CONNECTION-STREAM marks a request boundary on it, so the loop's
;;;; next read answers end-of-file when no further request is buffered.  The
;;;; loop then returns and closes the stream, and Gallop parks the
;;;; connection instead of closing it.
;;;;
;;;; With GALLOP:ACCEPTOR the engine accepts on the listen socket itself (a
;;;; non-blocking accept loop that handler work never delays).  With any other
;;;; Hunchentoot acceptor, the acceptor's own ACCEPT-CONNECTIONS runs in a
;;;; listener thread and hands each socket to HANDLE-INCOMING-CONNECTION.

(in-package #:gallop)

(defconstant +minimum-backlog+ 1024
  "The listen backlog GALLOP:TASKMASTER gives a stock acceptor's socket.")

(defvar *taskmasters* (make-hash-table :test 'eq :weakness :key :synchronized t)
  "Each running acceptor's GALLOP:TASKMASTER.  Hunchentoot exports no way from
an acceptor to its taskmaster.")

(defun acceptor-gallop-taskmaster (acceptor)
  "The GALLOP:TASKMASTER running ACCEPTOR, or NIL."
  (values (gethash acceptor *taskmasters*)))

(macrolet ((define-taskmaster-class (slots &rest options)
             ;; One slot per setting (+SETTINGS+, src/core/settings.lisp), then SLOTS.
             `(defclass taskmaster (hunchentoot:taskmaster)
                (,@(gallop.core:setting-slot-definitions
                    :readers '(:max-thread-count hunchentoot:taskmaster-max-thread-count
                               :standby-thread-count taskmaster-standby-thread-count)
                    ;; NIL: from the acceptor (see MAKE-TASKMASTER-ENGINE)
                    :initforms '(:header-timeout nil :idle-timeout nil :read-timeout nil
                                 :write-timeout nil :max-queue-length nil))
                 ,@slots)
                ,@options)))
  (define-taskmaster-class
      ((max-accept-count :initarg :max-accept-count
                         :initform nil
                         :reader hunchentoot:taskmaster-max-accept-count
                         :documentation "As in Hunchentoot: when given, connections beyond
this many (being served or waiting) get 503.  Gallop counts only connections
that wait for their first request to be served, so this sets
MAX-QUEUE-LENGTH to MAX-ACCEPT-COUNT - MAX-THREAD-COUNT.")
       (engine :initform nil :reader taskmaster-engine
               :documentation "The running engine of the core (src/core/engine.lisp), or NIL.")
       (listener :initform nil
                 :documentation "The thread running the acceptor's ACCEPT-CONNECTIONS,
when the acceptor is not a GALLOP:ACCEPTOR.")
       (soft-stop :initform nil :accessor taskmaster-soft-stop)
       (answer-log :initform nil :accessor taskmaster-answer-log
                   :documentation "The lines of the engine's own answers waiting for
their writer, and the count of those dropped, since the engine started (an
ANSWER-LOG, access-log.lisp)."))
    (:documentation "A taskmaster that serves requests from an elastic pool of
threads (no thread per connection) and keeps idle connections in epoll.  Use
it with any Hunchentoot acceptor:

  (make-instance 'hunchentoot:easy-acceptor :port 4242
                 :taskmaster (make-instance 'gallop:taskmaster :max-thread-count 8))

Its initargs are the settings every Gallop server takes, with the same
defaults (the table +SETTINGS+ of src/core/settings.lisp), except that the
timeouts default to the acceptor's: HEADER-TIMEOUT, IDLE-TIMEOUT and
READ-TIMEOUT to its read timeout, WRITE-TIMEOUT to its write timeout; and
MAX-QUEUE-LENGTH, when not given, follows MAX-ACCEPT-COUNT.")))

(defmethod initialize-instance :after ((tm taskmaster) &key)
  (with-slots (max-thread-count standby-thread-count) tm
    (setf standby-thread-count (max 1 (min standby-thread-count max-thread-count)))))

(defgeneric taskmaster-max-queue-length (taskmaster)
  (:documentation "How many accepted connections may wait for a worker before
new connections get 503.")
  (:method ((tm taskmaster))
    (with-slots (max-queue-length max-accept-count max-thread-count) tm
      (cond (max-queue-length)
            (max-accept-count (max 0 (- max-accept-count max-thread-count)))
            (t (gallop.core:setting-default max-queue-length))))))

(defmethod hunchentoot:taskmaster-thread-count ((tm taskmaster))
  (let ((engine (taskmaster-engine tm)))
    (if engine (gallop.core:pool-thread-count (gallop.core:engine-pool engine)) 0)))

(defmethod hunchentoot:increment-taskmaster-thread-count ((tm taskmaster))
  nil)

(defmethod hunchentoot:decrement-taskmaster-thread-count ((tm taskmaster))
  nil)

(defmethod stats ((tm taskmaster))
  (let ((engine (taskmaster-engine tm)))
    (and engine (append (gallop.core:engine-stats engine)
                        (list :access-log-dropped
                              (let ((log (taskmaster-answer-log tm)))
                                ;; (Defined in access-log.lisp, loaded after.)
                                (declare (notinline answer-log-dropped))
                                (if log (answer-log-dropped log) 0)))))))

(defmethod server-pool ((tm taskmaster))
  (let ((engine (taskmaster-engine tm)))
    (and engine (gallop.core:engine-pool engine))))

(defmethod server-pool ((acceptor hunchentoot:acceptor))
  (let ((tm (acceptor-gallop-taskmaster acceptor)))
    (and tm (server-pool tm))))

(defmethod stats ((acceptor hunchentoot:acceptor))
  (let ((tm (acceptor-gallop-taskmaster acceptor)))
    (and tm (stats tm))))

(defun process-gallop-connection (acceptor connection)
  "The engine's handler: run Hunchentoot's request loop on CONNECTION.  It
gets a CONNECTION-USOCKET (socket.lisp), also for a socket Hunchentoot's own
ACCEPT-CONNECTIONS accepted: the peer's address is the one accept gave, so
no getpeername(2) can fail for a client that already reset (Hunchentoot
1.3.x asks for it before the UNWIND-PROTECT that closes its stream).
Returns what becomes of the connection (see GALLOP.CORE:MAKE-ENGINE), all
decided here:
 - :SUSPENDED: a request is answered later (defer.lisp);
 - :DETACHED: a handler kept the stream (HUNCHENTOOT:DETACH-SOCKET), but
   not one that switched protocols and read the new one in the handler's
   loop (SWITCH-PROTOCOLS): that one is done;
 - :KEEP-ALIVE: the loop ended because no further request was there
   (*REQUESTS-ENDED*), on the connection itself (with TLS through a library
   above the engine the loop read every request of the connection);
 - :CLOSE otherwise: the loop ended on Connection: close, a stop, an error.
Unless detached or suspended, the stream is closed here too, whichever way
PROCESS-CONNECTION returned."
  (let ((*connection* connection)
        (*requests-ended* nil)
        (socket (or (connection-user-data connection)
                    (setf (connection-user-data connection)
                          (make-connection-usocket connection)))))
    (flet ((outcome ()
             (cond ((usocket-deferred socket) :suspended)
                   ((gallop.core:connection-switched-p connection) :close)
                   ((gallop.core:connection-detached-p connection) :detached)
                   ((and *requests-ended* (eq (request-connection) connection)) :keep-alive)
                   (t :close))))
      (let ((outcome nil))
        (unwind-protect (progn (hunchentoot:process-connection acceptor socket)
                               (setf outcome (outcome)))
          (unless (member (or outcome (outcome)) '(:suspended :detached))
            (close connection :abort t)))
        outcome))))

(defun acceptor-tls-context (acceptor)
  "A TLS context for ACCEPTOR when it is a HUNCHENTOOT:SSL-ACCEPTOR (its
certificate, key and password): Gallop's engine then speaks TLS itself, on
its event loop, and Hunchentoot reads and writes plaintext.  NIL otherwise;
another acceptor whose ACCEPTOR-SSL-P is true wraps the stream itself (the
engine is raw then, see gallop.core's tls.lisp)."
  (when (typep acceptor 'hunchentoot:ssl-acceptor)
    (gallop.core:make-tls-context
     :certificate-file (hunchentoot:acceptor-ssl-certificate-file acceptor)
     :private-key-file (hunchentoot:acceptor-ssl-privatekey-file acceptor)
     :password (hunchentoot:acceptor-ssl-privatekey-password acceptor))))

(defgeneric acceptor-streams-body-p (acceptor method path)
  (:documentation "True when the handler of a request with METHOD (a
keyword) and PATH (the request target as sent, without its query and not
percent-decoded: the script name before decoding) reads the request's body
as it arrives, through HUNCHENTOOT:RAW-POST-DATA's stream (a proxy, an
upload processed on the fly).  Otherwise Gallop reads the whole body first, in
epoll, into memory or a temporary file, and the handler starts with it at
hand.  A streamed body holds a worker while it arrives, bounded by the
minimum data rate.  Specialize it on your acceptor class to choose per
route; a GALLOP:TASKMASTER's :STREAMED-BODIES function, when given, is asked
first.  The default method says NIL.")
  (:method (acceptor method path)
    (declare (ignore acceptor method path))
    nil))

(defun make-taskmaster-engine (tm acceptor)
  (let ((read-timeout (or (slot-value tm 'read-timeout)
                          (hunchentoot:acceptor-read-timeout acceptor)
                          (gallop.core:setting-default read-timeout)))
        (write-timeout (or (slot-value tm 'write-timeout)
                           (hunchentoot:acceptor-write-timeout acceptor)
                           (gallop.core:setting-default write-timeout)))
        (tls (acceptor-tls-context acceptor)))
    (macrolet ((setting-of (name) `(slot-value tm ',name)))
      ;; The first of a repeated keyword counts: the acceptor's timeouts
      ;; and the queue length first, then every setting as given.
      (apply #'gallop.core:make-engine
             :name (format nil "gallop-~A" (hunchentoot:acceptor-port acceptor))
             :handler (lambda (connection) (process-gallop-connection acceptor connection))
             :tls-context tls
             :raw (and (null tls) (hunchentoot:acceptor-ssl-p acceptor))
             :methods (hunchentoot-request-methods)
             :thread-starter (lambda (thunk name)
                               (hunchentoot:start-thread tm thunk :name name))
             :log-error (lambda (format-control &rest args)
                          (apply #'hunchentoot:acceptor-log-message acceptor :error
                                 format-control args))
             ;; The answers the engine writes itself (access-log.lisp).
             :log-answer (lambda (c status bytes buffer start end)
                           (log-answer-line tm acceptor c status bytes buffer start end))
             :header-timeout (or (setting-of header-timeout) read-timeout)
             :idle-timeout (or (setting-of idle-timeout) read-timeout)
             :read-timeout read-timeout
             :write-timeout write-timeout
             :max-queue-length (taskmaster-max-queue-length tm)
             :streamed-bodies (let ((own (setting-of streamed-bodies)))
                                (lambda (method path)
                                  (or (and own (funcall own method path))
                                      (acceptor-streams-body-p acceptor method path))))
             (gallop.core:setting-arguments setting-of)))))

(defmethod hunchentoot:execute-acceptor ((tm taskmaster))
  (let* ((acceptor (serve-with-gallop (hunchentoot:taskmaster-acceptor tm)))
         (engine (make-taskmaster-engine tm acceptor)))
    (setf (slot-value tm 'engine) engine
          (taskmaster-soft-stop tm) nil
          (taskmaster-answer-log tm)
          (make-answer-log acceptor (let ((pool (gallop.core:engine-pool engine)))
                                      (lambda (thunk) (gallop.core:pool-submit pool thunk)))))
    (setf (gethash acceptor *taskmasters*) tm)
    (cond ((typep acceptor 'acceptor)
           (gallop.core:engine-start
            engine :listen-fd (gallop.core:listen-socket-fd
                               (usocket:socket (acceptor-listen-usocket acceptor)))
                   ;; A socket a supervisor passed is its to keep for the
                   ;; next process, with the connections queued on it.
                   :own-listener (null (slot-value acceptor 'passed-fd))))
          (t
           (gallop.core:engine-start engine)
           ;; Connections cost no thread here, so let the kernel queue bursts
           ;; instead of refusing them: Hunchentoot's default backlog is 50.
           ;; listen(2) again on a listening socket just resizes its queue.
           (let ((listener (usocket:socket (acceptor-listen-usocket acceptor))))
             (when (< (hunchentoot:acceptor-listen-backlog acceptor) +minimum-backlog+)
               (sb-bsd-sockets:socket-listen listener +minimum-backlog+)))
           (setf (slot-value tm 'listener)
                 (hunchentoot:start-thread
                  tm (lambda () (hunchentoot:accept-connections acceptor))
                  :name (format nil "gallop-listener-~A" (hunchentoot:acceptor-port acceptor))))))
    (note-running acceptor t)
    tm))

(defmethod hunchentoot:handle-incoming-connection ((tm taskmaster) socket)
  ;; Called by Hunchentoot's ACCEPT-CONNECTIONS in the listener thread.
  ;; SOCKET only holds the fd for the engine now (and closes it): Hunchentoot
  ;; reads through a CONNECTION-USOCKET (SERVE-CONNECTION).
  (let* ((engine (taskmaster-engine tm))
         (fd (gallop.core:listen-socket-fd (usocket:socket socket)))
         (close-hook (lambda () (usocket:socket-close socket))))
    (cond ((null engine) (funcall close-hook))
          ((gallop.core:engine-overloaded-p engine)
           (multiple-value-bind (address port)
               (ignore-errors (usocket:get-peer-name socket))
             (gallop.core:engine-shed-fd engine fd :close-hook close-hook
                                                   :remote-address address :remote-port port)))
          (t
           (multiple-value-bind (address port)
               (ignore-errors (usocket:get-peer-name socket))
             (gallop.core:engine-adopt-fd engine fd :close-hook close-hook
                                                    :remote-address address
                                                    :remote-port port))))))

(defmethod hunchentoot:shutdown ((tm taskmaster))
  (note-running (hunchentoot:taskmaster-acceptor tm) nil)
  (with-slots (listener engine) tm
    (when listener
      (bt:join-thread listener)
      (setf listener nil))
    (when engine
      (gallop.core:engine-stop engine :soft (taskmaster-soft-stop tm))
      ;; Every thread that adds lines is joined now: write what is left.
      (let ((log (taskmaster-answer-log tm)))
        (when log (finish-answer-log log)))
      (let ((tls (gallop.core:engine-tls engine)))
        (when tls (gallop.core:free-tls-context tls)))
      (setf engine nil))
    (remhash (hunchentoot:taskmaster-acceptor tm) *taskmasters*))
  tm)

(defmethod hunchentoot:stop :before ((acceptor served-acceptor) &key soft)
  ;; SHUTDOWN is not told whether the stop is soft: note it for our taskmaster.
  ;; A soft stop is Gallop's, here, before Hunchentoot's: it ends the listen
  ;; socket without resetting what waits on it, and its wait for requests
  ;; in progress is bounded by STOP-TIMEOUT (Hunchentoot's is not).
  (let ((tm (acceptor-gallop-taskmaster acceptor)))
    (when tm
      (setf (taskmaster-soft-stop tm) soft)
      (let ((engine (taskmaster-engine tm)))
        (when (and soft engine)
          (note-running acceptor nil)
          (gallop.core:engine-stop engine :soft t))))))

(defun wake-for-shutdown-failure-p (acceptor format-string)
  "True for the message Hunchentoot's STOP logs when its wake-up connection
to the listen socket fails (WAKE-FOR-SHUTDOWN-MESSAGE), once Gallop's soft
stop of ACCEPTOR stopped its engine."
  (and (equal format-string (wake-for-shutdown-message))
       (let ((engine (server-engine-of acceptor)))
         (and engine (not (gallop.core:engine-running-p engine))))))

(defmethod server-engine-of ((acceptor hunchentoot:acceptor))
  (let ((tm (acceptor-gallop-taskmaster acceptor)))
    (and tm (taskmaster-engine tm))))

(defmethod stop-softly ((acceptor hunchentoot:acceptor))
  (hunchentoot:stop acceptor :soft t))

(defun readiness (&optional (acceptor hunchentoot:*acceptor*))
  "The body of a Hunchentoot handler for a readiness URL: \"ready\" while
ACCEPTOR (the one serving the request) is READY-P; otherwise the return code
is set to 503 and it is \"draining\".
  (hunchentoot:define-easy-handler (ready :uri \"/ready\") () (gallop:readiness))"
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:header-out :cache-control) "no-store")
  (cond ((ready-p acceptor) "ready")
        (t (setf (hunchentoot:return-code*) hunchentoot:+http-service-unavailable+)
           "draining")))

(defmethod hunchentoot:too-many-taskmaster-requests ((tm taskmaster) socket)
  (declare (ignore socket))
  nil)

(defmethod hunchentoot:handle-request :around ((acceptor served-acceptor) request)
  ;; On a Gallop connection (an answer written while the server stops, or
  ;; after which the connection must close, says so when its head is
  ;; written: WRITE-RESPONSE, heads.lisp):
  ;;  - a client's malformed or oversized chunked body
  ;;    (GALLOP.CORE:REQUEST-BODY-ERROR, signalled while the handler reads
  ;;    it) is answered 400 or 413, like any bad request, not a logged 500;
  ;;  - a body the handler returns is written once and never touched again
  ;;    (a string is encoded afresh; an octet vector is the handler's to give
  ;;    up, see doc/native-api.md): if the client does not read it at once, it
  ;;    waits with the connection by reference, not copied, and so holds no
  ;;    worker whatever its size (GALLOP.CORE:CONNECTION-GIVE-BODY).
  ;; (A body the handler did not read is left to Gallop: see
  ;; ACCEPTOR-LOG-ACCESS below.)
  (declare (ignore request))
  (let ((c (request-connection)))
    (if (null c)
        (call-next-method)
        (handler-case (multiple-value-call
                          ;; Hunchentoot 1.2.38 reads three values here
                          ;; (contents, error, backtrace); 1.3.x the first.
                          (lambda (&optional contents error backtrace)
                            (when (typep contents '(or string (vector (unsigned-byte 8))))
                              (gallop.core:connection-give-body c))
                            (values contents error backtrace))
                        (call-next-method))
          (gallop.core:request-body-error (condition)
            (setf (hunchentoot:return-code*) (gallop.core:request-body-error-status condition))
            (hunchentoot:abort-request-handler))))))

(defun leave-unread-body (request)
  "Before Hunchentoot answers REQUEST: if its body was not read, mark it as
consumed (see compat.lisp), so that Hunchentoot does not read it into memory."
  (let ((slot (raw-post-data-slot))
        (c (request-connection)))
    (when (and c
               (gallop.core:connection-body-pending-p c)
               (null (slot-value request slot)))
      (setf (slot-value request slot) t))))

(defmethod hunchentoot:acceptor-log-access :before ((acceptor served-acceptor) &key return-code)
  ;; Hunchentoot's SEND-RESPONSE calls this, then reads the body the handler
  ;; left unread into memory ("to clear the stream"): all of it, and a
  ;; chunked one with ADJUST-ARRAY 8 KiB at a time, copying what it has each
  ;; time.  On a Gallop connection each request's stream ends at its own
  ;; end, and Gallop skips an unread body if it is here or closes the
  ;; connection after the answer: mark it consumed instead.  This runs for
  ;; every answer, whether the handler returned it or sent it through
  ;; HUNCHENTOOT:SEND-HEADERS (as HANDLE-STATIC-FILE does).  (A handler that
  ;; reads RAW-POST-DATA only after SEND-HEADERS then gets NIL.)
  (declare (ignore return-code))
  (when (and *connection* (boundp 'hunchentoot:*request*) hunchentoot:*request*)
    (leave-unread-body hunchentoot:*request*)))

(defun client-abort-condition-p (object)
  "True if OBJECT is a condition saying the client went away (it closed or
reset the connection); timeouts don't count.  Hunchentoot maps every
condition that crosses its USOCKET:WITH-MAPPED-CONDITIONS into a
USOCKET:UNKNOWN-ERROR (twice, when it crosses two), so those are looked into."
  (typecase object
    (gallop.core:connection-timeout-error nil)
    (gallop.core:connection-error t)
    (usocket:unknown-error
     (client-abort-condition-p (usocket-real-error object)))))

(defun client-timeout-condition-p (object)
  "True if OBJECT is a condition saying a read or write on the client's
connection made no progress in time (looked into as CLIENT-ABORT-CONDITION-P
does)."
  (typecase object
    (gallop.core:connection-timeout-error t)
    (usocket:unknown-error
     (client-timeout-condition-p (usocket-real-error object)))))

(defmethod hunchentoot:acceptor-log-message :around ((acceptor served-acceptor) log-level
                                                     format-string &rest format-arguments)
  ;; On a Gallop connection:
  ;;  - a client that hung up mid-request or mid-response, which Hunchentoot
  ;;    logs as an error, is counted in GALLOP:STATS (:ABORTED) instead, as
  ;;    the native API does;
  ;;  - a client that timed out is logged at most once a minute, with the
  ;;    count of those not logged (GALLOP.CORE:TIMEOUT-LINE-DUE);
  ;;  - no message is longer than GALLOP.CORE:+MAX-LOG-LINE+: one that would
  ;;    be is passed on cut, as a string; any other as it came, so that
  ;;    methods of the user's see the arguments.  A message whose making
  ;;    fails is passed on as it came, for Hunchentoot's own handling.
  (flet ((bounded ()
           (handler-case (gallop.core:format-log-line format-string format-arguments)
             (error () (return-from hunchentoot:acceptor-log-message (call-next-method))))))
    (cond ((wake-for-shutdown-failure-p acceptor format-string)
           ;; Gallop's soft stop shut the listen socket already: Hunchentoot's
           ;; wake-up connection to it is refused, as it should be.
           nil)
          ((null *connection*) (call-next-method))
          ((some #'client-abort-condition-p format-arguments)
           (gallop.core:note-client-abort (gallop.core:connection-engine *connection*)))
          ((null (hunchentoot:acceptor-message-log-destination acceptor))
           nil)
          ((some #'client-timeout-condition-p format-arguments)
           (let ((skipped (gallop.core:timeout-line-due
                           (gallop.core:connection-engine *connection*))))
             (when skipped
               (call-next-method acceptor log-level "~A~[~:;~:* (and ~D more client timeouts ~
                                                      in the last minute, not logged)~]"
                                 (bounded) skipped))))
          (t
           (multiple-value-bind (text cut) (bounded)
             (if cut
                 (call-next-method acceptor log-level "~A" text)
                 (call-next-method)))))))

(defmethod hunchentoot:detach-socket :after ((acceptor served-acceptor))
  ;; The handler keeps the stream (a WebSocket, a tunnel): Gallop stops
  ;; framing requests on it, so the handler reads what the client sends next.
  (let ((c (request-connection)))
    (when c
      (gallop.core:connection-detach c))))

(defun switch-protocols (c)
  "A 101 answer goes out on the Gallop connection C: the handler (hunchensocket's
PROCESS-REQUEST :AFTER) reads the new protocol from C's stream in its own
loop, in this worker, until the client leaves.  C passes its octets through
from now on and the worker leaves the pool's count (GALLOP.CORE:CONNECTION-
SWITCH); the usocket PROCESS-CONNECTION was given gets a stream that takes
Hunchentoot's SET-TIMEOUTS (compat.lisp), whose timeout C's reads use."
  (let ((socket (connection-user-data c))
        (timeouts (make-timeout-stream)))
    (when (typep socket 'connection-usocket)
      (setf (usocket:socket-stream socket) timeouts))
    (gallop.core:connection-switch c :timeout-stream timeouts)))

;;; Request boundaries.  These methods act only while a Gallop worker serves a
;;; connection (*CONNECTION* is not NIL).

(defmethod hunchentoot:initialize-connection-stream :around ((acceptor served-acceptor) stream)
  (when (and *connection* (gallop.core:connection-tls-p *connection*))
    ;; The engine speaks TLS itself (ACCEPTOR-TLS-CONTEXT): Hunchentoot's
    ;; SSL-ACCEPTOR would wrap the plaintext in cl+ssl once more.
    (return-from hunchentoot:initialize-connection-stream stream))
  (let ((result (if (and *connection* (eq stream *connection*) (hunchentoot:acceptor-ssl-p acceptor))
                    ;; the TLS handshake: within the header timeout, as a head
                    (gallop.core:call-with-header-deadline *connection* #'call-next-method)
                    (call-next-method))))
    (if (and *connection* (eq stream *connection*) (not (eq result stream)))
        ;; Wrapped (TLS): Hunchentoot reads the plaintext through one more
        ;; Gallop connection, with the same checks and limits as a plain
        ;; socket (see gallop.core's tls.lisp); its boundaries count.
        (setf (connection-owner-stream *connection*)
              (gallop.core:make-plain-connection *connection* result
                                                 :pending (ssl-pending-function result)))
        result)))

(defmethod close :around ((stream gallop.core:connection) &key abort)
  ;; The plaintext side of a TLS connection closes its TLS stream, made over
  ;; *CONNECTION*: let cl+ssl's SSL_shutdown send close_notify through it
  ;; (see compat.lisp).
  (declare (ignore abort))
  (if (and *connection*
           (not (eq stream *connection*))
           (eq stream (connection-owner-stream *connection*)))
      (call-with-ssl-bio-stream *connection* #'call-next-method)
      (call-next-method)))

(defmethod hunchentoot:reset-connection-stream :around ((acceptor served-acceptor) stream)
  (let ((result
          (if (and *connection* (typep stream 'chunga:chunked-stream))
              ;; Hunchentoot turns chunking off here, and chunga refuses to
              ;; turn input chunking off while a chunk it read is not all
              ;; consumed (a handler that read part of a chunked body, or
              ;; whose client left mid-body): an error logged after the
              ;; answer was sent.  On a Gallop connection the rest of the
              ;; body is Gallop's to skip (FINISH-MESSAGE), so go on with the
              ;; socket stream; output chunking was turned off first.
              (handler-case (call-next-method)
                (chunga:chunga-error ()
                  (chunga:chunked-stream-stream stream)))
              (call-next-method))))
    (when *connection*
      (cond ((eq result *connection*)
             (connection-mark-boundary *connection*))
            ((eq result (connection-owner-stream *connection*))
             ;; TLS: the plaintext connection reads the next request.
             (connection-mark-boundary result))))
    result))
