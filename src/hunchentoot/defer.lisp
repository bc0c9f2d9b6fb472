;;;; defer.lisp -- GALLOP:DEFER-REQUEST: a Hunchentoot handler that answers
;;;; later, from another thread (a timer, a message, a long poll), holding no
;;;; worker meanwhile.
;;;;
;;;;   (hunchentoot:define-easy-handler (later :uri "/later") ()
;;;;     (setf (hunchentoot:content-type*) "text/plain")
;;;;     (let ((answer (gallop:defer-request)))
;;;;       (gallop:after 5 (lambda () (funcall answer "Hello!")))
;;;;       nil))
;;;;
;;;; DEFER-REQUEST suspends the request's connection (the engine's
;;;; CONNECTION-SUSPEND) and tells Hunchentoot its answer is sent, so
;;;; PROCESS-REQUEST writes none; the connection's next read answers end of
;;;; file, so PROCESS-CONNECTION's loop ends and the worker returns to the
;;;; pool, and the connection waits in epoll (where a client that resets is
;;;; seen at once).  The answer function, called from any other thread, takes
;;;; the connection back, binds the request's *ACCEPTOR*, *REQUEST*, *REPLY*
;;;; and *SESSION* and Hunchentoot's output specials again, and runs
;;;; Hunchentoot's own START-OUTPUT: the head, cookies, session, charset and
;;;; keep-alive are Hunchentoot's, as if the handler had returned the content.
;;;; Then the connection goes back to the engine for the next request.
;;;;
;;;; Invariants: a connection has at most one deferred request (its
;;;; CONNECTION-USOCKET's DEFERRED), set by the worker before it lets go and
;;;; cleared by the answer; the answer runs once.

(in-package #:gallop)

(defstruct (deferred (:constructor make-deferred (connection acceptor request reply session)))
  connection acceptor request reply session
  (answered nil))

(defmethod print-object ((deferred deferred) stream)
  (print-unreadable-object (deferred stream :type t :identity t)))

(defun defer-request ()
  "In a Hunchentoot handler served by Gallop (a Gallop acceptor, or
GALLOP:TASKMASTER): answer this request later, from another thread, and let
the worker go now.  Returns the answer, a function of one optional argument,
the content (a string or an octet vector, as a handler would return; NIL:
Hunchentoot's page for the return code), to call once, from any thread but
this handler's own: it sends the answer with what the handler set in
*REPLY* (return code, headers, cookies, content type) and returns T, or NIL
when the client went away first (nothing is sent then, nothing logged).
What the handler returns after DEFER-REQUEST is ignored.  Not on a TLS
connection wrapped by the acceptor itself (see doc/hunchentoot.md)."
  (let ((c (request-connection)))
    (unless (and c (eq c *connection*) (typep (connection-user-data c) 'connection-usocket))
      (error "GALLOP:DEFER-REQUEST needs a Hunchentoot handler served by Gallop."))
    (when (connection-deferred c)
      (error "This request was deferred already."))
    (let ((deferred (make-deferred c hunchentoot:*acceptor* hunchentoot:*request*
                                   hunchentoot:*reply* hunchentoot:*session*)))
      (setf (usocket-deferred (connection-user-data c)) deferred)
      (gallop.core:connection-suspend c)
      ;; PROCESS-REQUEST writes no answer of its own.
      (hunchentoot-headers-sent)
      (lambda (&optional content) (answer-deferred deferred content)))))

(defun answer-deferred (deferred content)
  (let ((c (deferred-connection deferred)))
    (when (eq *connection* c)
      ;; Still in the handler that deferred it: its worker has not let go
      ;; of C, and would wait for itself.
      (error "Answer a deferred request from another thread (a timer, a ~
              message), or return the content instead of deferring."))
    (when (shiftf (deferred-answered deferred) t)
      (error "This deferred request was answered already."))
    (unless (gallop.core:connection-acquire c)
      ;; The client went away (or the server stopped) first.
      (gallop.core:connection-resume c nil)
      (return-from answer-deferred nil))
    (setf (usocket-deferred (connection-user-data c)) nil)
    (let ((keep-alive nil)
          (sent nil))
      (handler-case
          (let ((*connection* c)
                (hunchentoot:*acceptor* (deferred-acceptor deferred))
                (hunchentoot:*request* (deferred-request deferred))
                (hunchentoot:*reply* (deferred-reply deferred))
                (hunchentoot:*session* (deferred-session deferred)))
            (with-hunchentoot-output-specials (c)
              ;; Written while the server stops: the connection then ends,
              ;; and the head says so.
              (unless (gallop.core:engine-running-p (gallop.core:connection-engine c))
                (setf (hunchentoot:header-out :connection) "Close"))
              (hunchentoot-start-output
               (hunchentoot:return-code*)
               (or content (hunchentoot:acceptor-status-message
                            hunchentoot:*acceptor* (hunchentoot:return-code*))))
              (finish-output c)
              (setf keep-alive (and (hunchentoot-keep-alive-p)
                                    (not (connection-token-p
                                          (hunchentoot:header-out :connection) "close")))
                    sent t)))
        (error (e)
          (if (client-abort-condition-p e)
              (gallop.core:note-client-abort (gallop.core:connection-engine c))
              (hunchentoot:acceptor-log-message (deferred-acceptor deferred) :error
                                                "Answering a deferred request: ~A" e))))
      (gallop.core:connection-resume c (and sent keep-alive (not (gallop.core:connection-close-after-p c))))
      sent)))
