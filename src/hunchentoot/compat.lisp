;;;; compat.lisp -- the one place Gallop touches Hunchentoot (and usocket,
;;;; cl+ssl) beyond their exported protocols.
;;;;
;;;; Gallop uses Hunchentoot's exported generic functions (START-LISTENING,
;;;; EXECUTE-ACCEPTOR, HANDLE-INCOMING-CONNECTION, PROCESS-CONNECTION,
;;;; INITIALIZE-CONNECTION-STREAM, RESET-CONNECTION-STREAM, SHUTDOWN, STOP ...)
;;;; and, where no exported name does the job, the internal names in
;;;; *INTERNAL-NAMES* below, and nowhere but in this file: the other files
;;;; call the functions defined here (tests/hunchentoot/compat.lisp checks
;;;; both).  Each is checked when this file loads, so that a Hunchentoot
;;;; that changes one fails then rather than at run time, and each has the
;;;; same name and meaning in every version tested (`make test`: Debian's
;;;; 1.2.38; `make test-ht13`: 1.3.1), but +VALID-REQUEST-METHODS+, which
;;;; 1.2.38 lacks.

(in-package #:gallop)

(defparameter *internal-names*
  '(;; (PACKAGE NAME KIND WHY USED-BY)
    ("HUNCHENTOOT" "ACCEPTOR-LISTEN-SOCKET" :accessor
     "the listen socket START-LISTENING made, taken over; or Gallop made"
     "taskmaster.lisp, acceptor.lisp")
    ("HUNCHENTOOT" "PORT" :slot
     "the port of a listen socket a supervisor passed, which it chose" "acceptor.lisp")
    ("HUNCHENTOOT" "+VALID-REQUEST-METHODS+" :constant
     "the methods 1.3.x reads (absent in 1.2.38: any)" "taskmaster.lisp")
    ("HUNCHENTOOT" "RAW-POST-DATA" :slot
     "a body nobody read is marked consumed, not read into memory" "taskmaster.lisp")
    ("HUNCHENTOOT" "ACCEPTOR-SHUTDOWN-P" :generic-function
     "a soft stop serves requests that arrived; read after a request"
     "this file, request-loop.lisp, in-progress.lisp, taskmaster.lisp")
    ("HUNCHENTOOT" "ACCEPTOR-SHUTDOWN-LOCK" :accessor
     "a soft STOP waits on it for requests in progress" "in-progress.lisp")
    ("HUNCHENTOOT" "ACCEPTOR-SHUTDOWN-QUEUE" :accessor
     "the same" "in-progress.lisp")
    ("HUNCHENTOOT" "GET-REQUEST-DATA" :function
     "a head the core's record cannot give (*HEADER-STREAM* set, part read)"
     "request-loop.lisp")
    ("HUNCHENTOOT" "SEND-RESPONSE" :function
     "wrapped: a response head goes straight to the connection" "heads.lisp")
    ("HUNCHENTOOT" "STRINGIFY-COOKIE" :generic-function
     "Set-Cookie values as SEND-RESPONSE writes them" "heads.lisp")
    ("HUNCHENTOOT" "START-OUTPUT" :function
     "a deferred answer is written by Hunchentoot's own code" "defer.lisp")
    ("HUNCHENTOOT" "*HUNCHENTOOT-STREAM*" :special
     "bound by the request loop, and again for a deferred answer" "request-loop.lisp, defer.lisp")
    ("HUNCHENTOOT" "*HEADERS-SENT*" :special "the same; and for HANDLER-DONE"
     "defer.lisp, acceptor.lisp, taskmaster.lisp, request-loop.lisp")
    ("HUNCHENTOOT" "*FINISH-PROCESSING-SOCKET*" :special "the same"
     "request-loop.lisp, defer.lisp, acceptor.lisp")
    ("HUNCHENTOOT" "*CLOSE-HUNCHENTOOT-STREAM*" :special "the same" "request-loop.lisp, defer.lisp")
    ("HUNCHENTOOT" "REQUEST-PROCESSED" :catch-tag
     "START-OUTPUT throws to it for a HEAD request" "defer.lisp")
    ("HUNCHENTOOT" "HANDLER-DONE" :catch-tag
     "a handler's error ends it as Hunchentoot's HANDLE-REQUEST does" "acceptor.lisp")
    ("HUNCHENTOOT" "GET-PEER-ADDRESS-AND-PORT" :function
     "the peer's address string for a request, made once a connection" "request-loop.lisp")
    ("HUNCHENTOOT" "GET-LOCAL-ADDRESS-AND-PORT" :function
     "the local address string, the same" "request-loop.lisp")
    ("HUNCHENTOOT" "MAYBE-ADD-CHARSET-TO-CONTENT-TYPE-HEADER" :function
     "wrapped: remembered per content type" "memo.lisp")
    ("HUNCHENTOOT" "*ACCESS-LOG-LOCK*" :special
     "the lock Hunchentoot's access-log lines are written under, for Gallop's" "access-log.lisp")
    ("HUNCHENTOOT" "REQUESTS-IN-PROGRESS" :slot
     "requests in progress, counted without a lock" "in-progress.lisp")
    ("USOCKET" "REAL-ERROR" :slot
     "the condition in the UNKNOWN-ERROR Hunchentoot makes of every one"
     "taskmaster.lisp, request-loop.lisp")
    ("CL+SSL" "SSL-STREAM" :class "telling a cl+ssl stream" "taskmaster.lisp")
    ("CL+SSL" "SSL-STREAM-HANDLE" :accessor "SSL_pending on its handle" "taskmaster.lisp")
    ("CL+SSL" "*SOCKET*" :special "close_notify through a Lisp BIO" "taskmaster.lisp"))
  "Every internal name of Hunchentoot, usocket and cl+ssl that Gallop uses:
\(PACKAGE NAME KIND WHY USED-BY), USED-BY naming the files that call this
file's function for it.  (Hunchentoot's SET-TIMEOUTS is not here: Gallop
does not call it; hunchensocket does, see MAKE-TIMEOUT-STREAM.)")

;;; The listen socket that Hunchentoot's own START-LISTENING creates is
;;; reachable only through the internal accessor ACCEPTOR-LISTEN-SOCKET
;;; (STOP uses it in both versions).

(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (fboundp (find-symbol "ACCEPTOR-LISTEN-SOCKET" '#:hunchentoot))
    (error "This Hunchentoot has no ACCEPTOR-LISTEN-SOCKET; Gallop needs it ~
            to take over the listen socket.")))

(defun hunchentoot-request-methods ()
  "The request methods this Hunchentoot serves, as a list of keywords, or
NIL for any.  Hunchentoot 1.3.x reads only those in its internal constant
+VALID-REQUEST-METHODS+ (GET, POST, HEAD, PUT, DELETE, CONNECT, OPTIONS,
TRACE, PATCH), compared without case, and answers any other with a
malformed HTTP/1.0 400 of its own; 1.2.38 has no such constant and reads
any method.  Gallop's engine refuses what this Hunchentoot would not read,
with 501 and exact case (methods are case-sensitive, RFC 9110 9.1), so that
both read every request the same way."
  (let ((symbol (find-symbol "+VALID-REQUEST-METHODS+" '#:hunchentoot)))
    (when (and symbol (boundp symbol))
      (coerce (symbol-value symbol) 'list))))

(defun acceptor-listen-usocket (acceptor)
  "The usocket Hunchentoot's START-LISTENING created for ACCEPTOR, or NIL."
  (funcall (find-symbol "ACCEPTOR-LISTEN-SOCKET" '#:hunchentoot) acceptor))

(defun (setf acceptor-listen-usocket) (usocket acceptor)
  "Make USOCKET ACCEPTOR's listen socket, as START-LISTENING does (STOP
closes it)."
  (funcall (fdefinition (list 'setf (find-symbol "ACCEPTOR-LISTEN-SOCKET" '#:hunchentoot)))
           usocket acceptor))

;;; HUNCHENTOOT:ACCEPTOR-PORT is a reader of the slot PORT (same name in
;;; 1.2.38 and 1.3.x), which START-LISTENING's :AFTER method sets when it
;;; was 0; a socket a supervisor passed has the port the supervisor chose.
;;; (Named by the symbol, not a string: usocket has an internal PORT too.)
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (find 'hunchentoot::port (sb-mop:class-direct-slots (find-class 'hunchentoot:acceptor))
                :key #'sb-mop:slot-definition-name)
    (error "This Hunchentoot's ACCEPTOR has no PORT slot.")))

(defun set-acceptor-port (acceptor port)
  "Make PORT what HUNCHENTOOT:ACCEPTOR-PORT of ACCEPTOR answers."
  (setf (slot-value acceptor 'hunchentoot::port) port))

;;; Not Hunchentoot's, but read the same way: the condition inside the
;;; USOCKET:UNKNOWN-ERROR that Hunchentoot's WITH-MAPPED-CONDITIONS makes of
;;; every condition (CLIENT-ABORT-CONDITION-P looks into it), slot REAL-ERROR
;;; in usocket 0.8.x.
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (find "REAL-ERROR" (sb-mop:class-direct-slots (find-class 'usocket:unknown-error))
                :key (lambda (slot) (symbol-name (sb-mop:slot-definition-name slot)))
                :test #'string=)
    (error "This usocket's UNKNOWN-ERROR has no REAL-ERROR slot.")))

(defun usocket-real-error (condition)
  "The condition inside the USOCKET:UNKNOWN-ERROR CONDITION, or NIL."
  (ignore-errors (slot-value condition 'usocket::real-error)))

;;; The slot behind HUNCHENTOOT:RAW-POST-DATA (REQUEST, same name in 1.2.38
;;; and 1.3.x).  When a handler did not read the request body, Hunchentoot's
;;; SEND-RESPONSE reads all of it into memory (to "clear the stream") before
;;; it answers; Gallop ends each request's stream at its own
;;; end, so that is not needed, and up to MAX-BODY-BYTES per request is too
;;; much to spend on a body nobody wants.  Setting the slot to T, which
;;; Hunchentoot itself stores once multipart data was consumed, makes
;;; RAW-POST-DATA answer NIL without reading.
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (find "RAW-POST-DATA" (sb-mop:class-direct-slots (find-class 'hunchentoot:request))
                :key (lambda (slot) (symbol-name (sb-mop:slot-definition-name slot)))
                :test #'string=)
    (error "This Hunchentoot's REQUEST has no RAW-POST-DATA slot.")))

(defun raw-post-data-slot ()
  "The name of the slot behind HUNCHENTOOT:RAW-POST-DATA."
  (load-time-value (find-symbol "RAW-POST-DATA" '#:hunchentoot) t))

;;; Not Hunchentoot's either: cl+ssl's stream keeps its OpenSSL handle in
;;; the internal accessor SSL-STREAM-HANDLE (cl+ssl 2019 to now), and binds
;;; no SSL_pending.  Gallop asks SSL_pending whether a TLS connection has a
;;; decrypted request waiting before it waits on the socket for one (see
;;; gallop.core's tls.lisp).
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (fboundp (find-symbol "SSL-STREAM-HANDLE" '#:cl+ssl))
    (error "This cl+ssl has no SSL-STREAM-HANDLE.")))

(defun ssl-pending-function (stream)
  "A function answering whether the cl+ssl STREAM holds decrypted octets not
read yet, or NIL if STREAM is not a cl+ssl stream."
  (let ((handle-of (find-symbol "SSL-STREAM-HANDLE" '#:cl+ssl)))
    (when (typep stream (find-symbol "SSL-STREAM" '#:cl+ssl))
      (lambda ()
        (let ((handle (funcall handle-of stream)))
          (and handle
               (plusp (sb-alien:alien-funcall
                       (sb-alien:extern-alien "SSL_pending"
                                              (function sb-alien:int sb-sys:system-area-pointer))
                       handle))))))))

;;; Also cl+ssl's: over a Lisp stream (a Gallop connection has no fd for
;;; OpenSSL), its BIO writes to the special variable *SOCKET*, which cl+ssl
;;; binds around SSL_read and SSL_write but not around the SSL_shutdown in
;;; its CLOSE (cl+ssl 2019 to 2022 at least).  Unbound there, the BIO's write
;;; fails quietly and close_notify is never sent: every TLS connection would
;;; end as an "incomplete close", which a client (OpenSSL 3: "unexpected eof
;;; while reading") cannot tell from a cut answer.  RFC 9112 section 9.8:
;;; a server must attempt the exchange of closure alerts.  Gallop binds it.
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (find-symbol "*SOCKET*" '#:cl+ssl)
    (error "This cl+ssl has no *SOCKET*.")))

(defun call-with-ssl-bio-stream (stream function)
  "Call FUNCTION with cl+ssl's Lisp BIO writing to STREAM (the stream a TLS
stream was made over), as it does inside cl+ssl's own calls."
  (progv (list (find-symbol "*SOCKET*" '#:cl+ssl)) (list stream)
    (funcall function)))

;;; ACCEPTOR-SHUTDOWN-P (internal accessor, same in 1.2.38 and 1.3.x):
;;; the request loop (Hunchentoot's, or Gallop's in request-loop.lisp)
;;; checks it before reading each request and returns when it is true.
;;; During a soft stop Gallop still serves the requests that had already
;;; arrived (engine-stop :soft), so for a connection whose checked request
;;; head the loop has not read yet, it answers NIL (the method below).  Elsewhere (counting requests in progress, STOP) it is
;;; untouched.
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (typep (fdefinition (find-symbol "ACCEPTOR-SHUTDOWN-P" '#:hunchentoot))
                 'generic-function)
    (error "This Hunchentoot's ACCEPTOR-SHUTDOWN-P is not a generic function.")))

(defmethod hunchentoot::acceptor-shutdown-p :around ((acceptor served-acceptor))
  ;; A request that arrived before a soft stop is served.
  (and (not (let ((c (request-connection)))
              (and c (gallop.core:connection-head-pending-p c))))
       (call-next-method)))

(defun hunchentoot-shutdown-p (acceptor)
  "True once HUNCHENTOOT:STOP began stopping ACCEPTOR."
  (hunchentoot::acceptor-shutdown-p acceptor))

(defun notify-hunchentoot-shutdown (acceptor)
  "Wake a soft HUNCHENTOOT:STOP of ACCEPTOR waiting for requests in
progress, as Hunchentoot does after each request."
  (bt:with-lock-held ((hunchentoot::acceptor-shutdown-lock acceptor))
    (bt:condition-notify (hunchentoot::acceptor-shutdown-queue acceptor))))
;;; GET-REQUEST-DATA and SEND-RESPONSE (internal functions, the same in
;;; 1.2.38 and 1.3.x): Hunchentoot reads every request head and writes every
;;; response head through them.  On a Gallop connection the request loop
;;; (request-loop.lisp) takes the head from the request record the core
;;; already parsed, and calls GET-REQUEST-DATA only where that record cannot
;;; serve; heads.lisp wraps SEND-RESPONSE (SB-INT:ENCAPSULATE), which
;;; START-OUTPUT calls, so that the response head goes straight into the
;;; connection's buffer: the speed of Gallop's Hunchentoot acceptors.  Their
;;; lambda lists are checked here, since Gallop calls the one and the wrapper
;;; of the other takes and gives the same arguments and values.
;;; STRINGIFY-COOKIE (internal generic function) is what SEND-RESPONSE
;;; writes a Set-Cookie header with.
(defun check-internal-function (name lambda-list)
  (let ((symbol (find-symbol name '#:hunchentoot)))
    (unless (and symbol (fboundp symbol)
                 (equal (mapcar #'symbol-name (sb-introspect:function-lambda-list symbol))
                        lambda-list))
      (error "This Hunchentoot's ~A is not a function of ~S: Gallop needs it."
             name lambda-list))
    symbol))

(defun wrap-hunchentoot-function (name function)
  "Make FUNCTION, called with Hunchentoot's own function and the arguments,
what NAME (one checked here) does; loading this again replaces it."
  (when (sb-int:encapsulated-p name 'gallop)
    (sb-int:unencapsulate name 'gallop))
  (sb-int:encapsulate name 'gallop function))

(defun hunchentoot-get-request-data ()
  (load-time-value (check-internal-function "GET-REQUEST-DATA" '("STREAM")) t))

(defun hunchentoot-send-response ()
  (load-time-value (check-internal-function
                    "SEND-RESPONSE"
                    '("ACCEPTOR" "STREAM" "STATUS-CODE" "&KEY" "HEADERS" "COOKIES" "CONTENT"))
                   t))

(defun hunchentoot-stringify-cookie (cookie)
  "Hunchentoot's Set-Cookie value for COOKIE."
  (funcall (load-time-value (or (find-symbol "STRINGIFY-COOKIE" '#:hunchentoot)
                                (error "This Hunchentoot has no STRINGIFY-COOKIE."))
                            t)
           cookie))

;;; A request answered later (defer.lisp) is answered by Hunchentoot's own
;;; START-OUTPUT on another thread, with the specials PROCESS-CONNECTION and
;;; PROCESS-REQUEST bind around a request bound again there.  All internal,
;;; same names and meaning in 1.2.38 and 1.3.x; checked here.
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (fboundp (find-symbol "START-OUTPUT" '#:hunchentoot))
    (error "This Hunchentoot has no START-OUTPUT."))
  (unless (find-symbol "REQUEST-PROCESSED" '#:hunchentoot)
    (error "This Hunchentoot has no REQUEST-PROCESSED catch tag."))
  (dolist (name '("*HUNCHENTOOT-STREAM*" "*HEADERS-SENT*" "*FINISH-PROCESSING-SOCKET*"
                  "*CLOSE-HUNCHENTOOT-STREAM*"))
    (let ((symbol (find-symbol name '#:hunchentoot)))
      (unless (and symbol (eq :special (sb-int:info :variable :kind symbol)))
        (error "This Hunchentoot has no special variable ~A." name)))))

(defmacro with-hunchentoot-output-specials ((stream) &body body)
  "BODY with Hunchentoot's output specials bound as PROCESS-CONNECTION and
PROCESS-REQUEST bind them for a request on STREAM, before its answer."
  `(progv (list (find-symbol "*HUNCHENTOOT-STREAM*" '#:hunchentoot)
                (find-symbol "*HEADERS-SENT*" '#:hunchentoot)
                (find-symbol "*FINISH-PROCESSING-SOCKET*" '#:hunchentoot)
                (find-symbol "*CLOSE-HUNCHENTOOT-STREAM*" '#:hunchentoot))
       (list ,stream nil t t)
     ,@body))

(defmacro with-hunchentoot-connection-specials (&body body)
  "BODY with the specials Hunchentoot's PROCESS-CONNECTION binds for a
connection: its stream (read and set as %HUNCHENTOOT-STREAM), NIL until
set, and whether to close it at the end (%CLOSE-HUNCHENTOOT-STREAM), T."
  `(let ((,(find-symbol "*HUNCHENTOOT-STREAM*" '#:hunchentoot) nil)
         (,(find-symbol "*CLOSE-HUNCHENTOOT-STREAM*" '#:hunchentoot) t))
     ,@body))

(defmacro with-hunchentoot-request-specials (&body body)
  "BODY with the special PROCESS-CONNECTION binds for each request: whether
the connection ends after it (%FINISH-PROCESSING-SOCKET), T until
START-OUTPUT decides to keep it."
  `(let ((,(find-symbol "*FINISH-PROCESSING-SOCKET*" '#:hunchentoot) t))
     ,@body))

(macrolet ((define-special-aliases (&rest pairs)
             `(progn
                ,@(loop for (alias name) on pairs by #'cddr
                        collect `(define-symbol-macro ,alias
                                     ,(find-symbol name '#:hunchentoot))))))
  (define-special-aliases
    %hunchentoot-stream "*HUNCHENTOOT-STREAM*"
    %close-hunchentoot-stream "*CLOSE-HUNCHENTOOT-STREAM*"
    %finish-processing-socket "*FINISH-PROCESSING-SOCKET*"))

(defun hunchentoot-start-output (code content)
  "Hunchentoot's START-OUTPUT of CODE and CONTENT, caught where
PROCESS-REQUEST catches it (a HEAD request's throws)."
  (catch (load-time-value (find-symbol "REQUEST-PROCESSED" '#:hunchentoot) t)
    (funcall (find-symbol "START-OUTPUT" '#:hunchentoot) code content)))

(defun hunchentoot-headers-sent ()
  "Mark the current request's head as sent (PROCESS-REQUEST then writes no
answer of its own)."
  (setf (symbol-value (find-symbol "*HEADERS-SENT*" '#:hunchentoot)) t))

(defun hunchentoot-headers-sent-p ()
  "True once the current request's head went out."
  (symbol-value (find-symbol "*HEADERS-SENT*" '#:hunchentoot)))

(defun hunchentoot-keep-alive-p ()
  "After START-OUTPUT: true when Hunchentoot decided to keep the connection."
  (not (symbol-value (find-symbol "*FINISH-PROCESSING-SOCKET*" '#:hunchentoot))))

;;; Hunchentoot writes each access-log line under its global lock
;;; *ACCESS-LOG-LOCK* (internal, the same in 1.2.38 and 1.3.x).  The lines
;;; Gallop writes to an acceptor's access log take it too, so that theirs and
;;; Hunchentoot's never mix in one file or stream.
(eval-when (:compile-toplevel :load-toplevel :execute)
  (let ((symbol (find-symbol "*ACCESS-LOG-LOCK*" '#:hunchentoot)))
    (unless (and symbol (eq :special (sb-int:info :variable :kind symbol)))
      (error "This Hunchentoot has no special variable *ACCESS-LOG-LOCK*."))))

(defun hunchentoot-access-log-lock ()
  "The lock Hunchentoot holds while it writes an access-log line."
  (symbol-value (find-symbol "*ACCESS-LOG-LOCK*" '#:hunchentoot)))

;;; What Hunchentoot recomputes for every request from values that change
;;; at most once a second or once a connection: its exported RFC-1123-DATE,
;;; called without a time for each answer's Date header, and
;;; MAYBE-ADD-CHARSET-TO-CONTENT-TYPE-HEADER, both wrapped (memo.lisp); the
;;; two address functions, of one argument each, which Gallop's request
;;; loop calls once a connection (Hunchentoot's: 1.3.x once a
;;; PROCESS-CONNECTION, 1.2.38 once a request).  Internal, the same in
;;; 1.2.38 and 1.3.x.
(defun hunchentoot-rfc-1123-date ()
  (load-time-value
   (let ((lambda-list (sb-introspect:function-lambda-list 'hunchentoot:rfc-1123-date)))
     (unless (and (= 2 (length lambda-list))
                  (eq '&optional (first lambda-list))
                  (string= "TIME" (symbol-name (let ((time (second lambda-list)))
                                                 (if (consp time) (first time) time)))))
       (error "This Hunchentoot's RFC-1123-DATE is not a function of (&OPTIONAL TIME): ~
               Gallop's memo.lisp needs it."))
     'hunchentoot:rfc-1123-date)
   t))

(defun hunchentoot-get-peer-address-and-port ()
  (load-time-value (check-internal-function "GET-PEER-ADDRESS-AND-PORT" '("SOCKET")) t))

(defun hunchentoot-get-local-address-and-port ()
  (load-time-value (check-internal-function "GET-LOCAL-ADDRESS-AND-PORT" '("SOCKET")) t))

;;; Hunchentoot's count of requests in progress, kept without its lock on a
;;; Gallop connection (in-progress.lisp): the slot of the count, and the
;;; lock and queue a soft STOP waits with.  Internal, the same in 1.2.38 and
;;; 1.3.x (only the count's reader is named differently, so the slot is used
;;; by name).
(defun requests-in-progress-slot ()
  "The name of the slot of a HUNCHENTOOT:ACCEPTOR that counts its requests in
progress."
  (let ((slot (find "REQUESTS-IN-PROGRESS"
                    (sb-mop:class-direct-slots (find-class 'hunchentoot:acceptor))
                    :key (lambda (slot) (symbol-name (sb-mop:slot-definition-name slot)))
                    :test #'string=)))
    (unless (and slot (eql 0 (funcall (sb-mop:slot-definition-initfunction slot))))
      (error "This Hunchentoot's ACCEPTOR has no REQUESTS-IN-PROGRESS slot counting from 0."))
    (sb-mop:slot-definition-name slot)))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (dolist (name '("ACCEPTOR-SHUTDOWN-LOCK" "ACCEPTOR-SHUTDOWN-QUEUE" "ACCEPTOR-SHUTDOWN-P"))
    (unless (fboundp (find-symbol name '#:hunchentoot))
      (error "This Hunchentoot has no ~A." name))))

(defun hunchentoot-maybe-add-charset ()
  (load-time-value (check-internal-function "MAYBE-ADD-CHARSET-TO-CONTENT-TYPE-HEADER"
                                            '("CONTENT-TYPE" "EXTERNAL-FORMAT"))
                   t))

;;; HANDLE-REQUEST's error handling (errors.lisp): Hunchentoot's own method
;;; answers a handler's ERROR by throwing to the internal catch tag
;;; HANDLER-DONE the values (NIL condition backtrace), which PROCESS-REQUEST
;;; reports, after setting *FINISH-PROCESSING-SOCKET* when the head was
;;; already sent.  Gallop's method for its acceptors does the same with a
;;; bounded backtrace.  Same names and meaning in 1.2.38 and 1.3.x (the two
;;; specials are checked above).
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (find-symbol "HANDLER-DONE" '#:hunchentoot)
    (error "This Hunchentoot has no HANDLER-DONE catch tag.")))

(defun hunchentoot-handler-done (condition backtrace)
  "End the current request's handler as Hunchentoot's HANDLE-REQUEST does
when the handler signals CONDITION, with BACKTRACE (a string, or NIL)."
  (when (symbol-value (find-symbol "*HEADERS-SENT*" '#:hunchentoot))
    (setf (symbol-value (find-symbol "*FINISH-PROCESSING-SOCKET*" '#:hunchentoot)) t))
  (throw (load-time-value (find-symbol "HANDLER-DONE" '#:hunchentoot) t)
    (values nil condition backtrace)))

;;; Hunchentoot's SET-TIMEOUTS (internal, same in 1.2.38 and 1.3.x), which
;;; hunchensocket calls on PROCESS-CONNECTION's usocket after its 101: on
;;; SBCL it sets SB-IMPL::FD-STREAM-TIMEOUT of (USOCKET:SOCKET-STREAM
;;; USOCKET), a structure accessor that only an SB-SYS:FD-STREAM takes.  A
;;; Gallop connection is a Gray stream; after a 101 its usocket's stream
;;; becomes a bufferless fd-stream made for that (SB-IMPL::%MAKE-FD-STREAM,
;;; on no fd), never read or written, whose timeout the connection's reads
;;; then use (see SWITCH-PROTOCOLS in taskmaster.lisp).
(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (and (fboundp 'sb-impl::%make-fd-stream)
               (fboundp '(setf sb-impl::fd-stream-timeout)))
    (error "This SBCL has no SB-IMPL::%MAKE-FD-STREAM or settable FD-STREAM-TIMEOUT.")))

(defun make-timeout-stream ()
  "An SB-SYS:FD-STREAM on no fd, with no buffers: somewhere for
Hunchentoot's SET-TIMEOUTS to put a timeout."
  (sb-impl::%make-fd-stream :fd -1 :name "gallop: timeouts of a switched connection"))

;;; Hunchentoot's STOP (both versions) connects to the listen socket to wake
;;; its accepting thread, and logs an error when that fails.  A soft stop of
;;; Gallop's has shut the socket by then (so that what its queue held was
;;; served), and the connect is refused: that message, and only it, is not
;;; passed on (ACCEPTOR-LOG-MESSAGE in taskmaster.lisp).
(defun wake-for-shutdown-message ()
  "The format string of the message Hunchentoot logs when the wake-up
connection of its STOP fails."
  "Wake-for-shutdown connect failed: ~A")
