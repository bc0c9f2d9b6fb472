;;;; request-loop.lisp -- Hunchentoot's request loop on a Gallop connection.
;;;;
;;;; Hunchentoot's PROCESS-CONNECTION reads requests off one socket until the
;;;; client or a handler ends it.  On a Gallop connection, Gallop's primary
;;;; method takes the place of Hunchentoot's and runs SERVE-REQUESTS
;;;; instead: the same steps in the same
;;;; order (initialize the stream, then per request the shutdown check, the
;;;; head, a REPLY and a REQUEST of the acceptor's classes, chunked input,
;;;; PROCESS-REQUEST counted in progress, FINISH-OUTPUT, RESET-CONNECTION-
;;;; STREAM, and at the end the close), with what only Gallop can do there:
;;;;  - the head comes from the core's request record (READ-REQUEST-DATA);
;;;;  - the count of requests in progress is kept without the acceptor's
;;;;    lock (CALL-COUNTED-REQUEST);
;;;;  - the peer and local addresses are Hunchentoot's strings, made once a
;;;;    connection from what accept returned;
;;;;  - the loop notes when it ended because no further request was there
;;;;    (*REQUESTS-ENDED*): the connection is then kept;
;;;;  - it ends after an answer that said Connection: close, set by a
;;;;    handler or by Gallop while it stops (Hunchentoot would read on);
;;;;  - it ends at once, writing nothing more, after a request whose handler
;;;;    detached the stream (DETACH-SOCKET, or a 101 it answered): the
;;;;    stream is its owner's, whose threads may be writing to it
;;;;    (GALLOP.CORE:CONNECTION-DETACH sent what was written before).
;;;; The method is specialised on HUNCHENTOOT:ACCEPTOR, as Hunchentoot's is,
;;;; and on Gallop's CONNECTION-USOCKET (socket.lisp), which only Gallop
;;;; passes: so it is more specific than Hunchentoot's method and than none
;;;; on a subclass of HUNCHENTOOT:ACCEPTOR, whatever order a class lists its
;;;; superclasses in, and never applies to a connection Gallop does not
;;;; serve.  Hunchentoot's own :AROUND method (error logging, mapped
;;;; conditions, *ACCEPTOR*) and every method of the user's classes
;;;; (hunchensocket's :AROUND, a primary that calls the next) run around it
;;;; as around Hunchentoot's loop.
;;;;
;;;; Both Hunchentoot versions tested have this loop; 1.3.x asks for the
;;;; addresses once a connection, 1.2.38 once a request.

(in-package #:gallop)

(defun connection-addresses (socket)
  "The peer's and this end's (address-string port) of the CONNECTION-USOCKET
SOCKET, as Hunchentoot's own functions make them, made once a connection."
  (values (or (usocket-peer-names socket)
              (setf (usocket-peer-names socket)
                    (multiple-value-list
                     (funcall (hunchentoot-get-peer-address-and-port) socket))))
          (or (usocket-local-names socket)
              (setf (usocket-local-names socket)
                    (multiple-value-list
                     (funcall (hunchentoot-get-local-address-and-port) socket))))))

(defun chunked-input (acceptor stream headers)
  "STREAM, or for a request whose Transfer-Encoding (in the HEADERS alist)
names chunked, a chunga stream reading its chunks, as Hunchentoot's loop
makes it (an error when ACCEPTOR takes no chunked input)."
  (let ((codings (cdr (assoc :transfer-encoding headers :test #'eq))))
    (if (and codings
             (member "chunked" (cl-ppcre:split "\\s*,\\s*" codings) :test #'equalp))
        (if (hunchentoot:acceptor-input-chunking-p acceptor)
            (let ((chunked (chunga:make-chunked-stream stream)))
              (setf (chunga:chunked-stream-input-chunking-p chunked) t)
              chunked)
            (hunchentoot:hunchentoot-error "Client tried to use chunked encoding, ~
                                            but acceptor is configured to not use it."))
        stream)))

(defun stream-detached-p ()
  "True once the handler of the request being served detached its stream."
  (let ((c (request-connection)))
    (and c (gallop.core:connection-detached-p c))))

(defun serve-requests (acceptor socket)
  "Hunchentoot's request loop on the CONNECTION-USOCKET SOCKET of ACCEPTOR
\(see the file's header)."
  (let ((socket-stream (usocket:socket-stream socket)))
    (multiple-value-bind (remote local) (connection-addresses socket)
      (with-hunchentoot-connection-specials
        (unwind-protect
             (progn
               (setf %hunchentoot-stream
                     (hunchentoot:initialize-connection-stream acceptor socket-stream))
               (loop
                 (with-hunchentoot-request-specials
                   (when (hunchentoot-shutdown-p acceptor)
                     (return))
                   (multiple-value-bind (headers method uri protocol)
                       (read-request-data (hunchentoot-get-request-data) %hunchentoot-stream)
                     (unless method
                       (setf *requests-ended* t)
                       (return))
                     (let ((closing
                             (let ((hunchentoot:*reply*
                                     (make-instance (hunchentoot:acceptor-reply-class acceptor)))
                                   (hunchentoot:*session* nil))
                               (setf %hunchentoot-stream
                                     (chunked-input acceptor %hunchentoot-stream headers))
                               (call-counted-request
                                acceptor
                                (lambda ()
                                  (hunchentoot:process-request
                                   ;; What Hunchentoot's ACCEPTOR-MAKE-REQUEST makes.
                                   (make-instance (hunchentoot:acceptor-request-class acceptor)
                                                  :acceptor acceptor
                                                  :local-addr (first local)
                                                  :local-port (second local)
                                                  :remote-addr (first remote)
                                                  :remote-port (second remote)
                                                  :headers-in headers
                                                  :content-stream %hunchentoot-stream
                                                  :method method
                                                  :uri uri
                                                  :server-protocol protocol))))
                               (connection-token-p (hunchentoot:header-out :connection)
                                                   "close"))))
                       (when (stream-detached-p)
                         (return))
                       (finish-output %hunchentoot-stream)
                       (setf %hunchentoot-stream
                             (hunchentoot:reset-connection-stream acceptor %hunchentoot-stream))
                       ;; An answer that said Connection: close ends the
                       ;; connection (Hunchentoot would read on): the engine
                       ;; keeps one whose answer promised keep-alive, even
                       ;; when it began stopping meanwhile.
                       (when (or %finish-processing-socket closing)
                         (return)))))))
          (when %close-hunchentoot-stream
            (flet ((close-stream (stream)
                     ;; At the end of the requests: errors flushing or
                     ;; closing are ignored, as Hunchentoot 1.3.x does
                     ;; (1.2.38 first offers them to the debugger when
                     ;; HUNCHENTOOT:*CATCH-ERRORS-P* is NIL).  Nothing is
                     ;; flushed on a stream its handler detached.
                     (unless (stream-detached-p)
                       (ignore-errors (finish-output stream)))
                     (ignore-errors (close stream :abort t))))
              (unless (or (null %hunchentoot-stream) (eq socket-stream %hunchentoot-stream))
                (close-stream %hunchentoot-stream))
              (close-stream socket-stream))))))))

;;; A request a stop cuts (the core's CUT-REQUESTS) gets HANDLER-TIMEOUT
;;; with no deadline in its worker.  Gallop's HANDLE-REQUEST (acceptor.lisp)
;;; catches it in the handler, the method below anywhere else in the
;;; request (a stock acceptor served by GALLOP:TASKMASTER has no such
;;; HANDLE-REQUEST; Hunchentoot's PROCESS-REQUEST wraps it in a
;;; USOCKET:UNKNOWN-ERROR); either logs the request once and leaves its 503
;;; to the engine (the core's RUN-HANDLER), which writes the same octets on
;;; both front ends.

(defun stop-cut-condition-p (object)
  "True if OBJECT is the HANDLER-TIMEOUT of a stop that cut the request, or
Hunchentoot's USOCKET:UNKNOWN-ERROR around one."
  (typecase object
    (handler-timeout (null (gallop.core:handler-timeout-seconds object)))
    (usocket:unknown-error (stop-cut-condition-p (usocket-real-error object)))))

(defun note-request-cut (acceptor)
  "In a request on a Gallop connection that a stop cut, in its dynamic
context: log the request's line at :WARNING, once (GALLOP.CORE:STOP-CUT-
MESSAGE); and unless its head went out or its handler detached the stream,
log the 503 the engine writes in the access log, and mark the head sent, so
that Hunchentoot writes nothing more.
On TLS through a library above the engine, which cannot write there, the
answer is left to Hunchentoot."
  (let ((request (and (boundp 'hunchentoot:*request*) hunchentoot:*request*)))
    (when (and *connection* request)
      (let* ((uri (hunchentoot:request-uri request))
             (line (gallop.core:stop-cut-message
                    *connection* (hunchentoot:request-method request)
                    (subseq uri 0 (position #\? uri))
                    (hunchentoot:remote-addr request) (hunchentoot:remote-port request))))
        (when line
          (hunchentoot:acceptor-log-message acceptor :warning "~A" line)))
      (when (and (eq (request-connection) *connection*)
                 ;; A detached stream is its owner's: the engine writes
                 ;; nothing there (the core's INTERRUPT-HANDLER).
                 (not (gallop.core:connection-detached-p *connection*))
                 (boundp 'hunchentoot:*reply*) hunchentoot:*reply*
                 (not (hunchentoot-headers-sent-p)))
        (setf (hunchentoot:return-code*) hunchentoot:+http-service-unavailable+
              (hunchentoot:content-length*) (gallop.core:error-body-bytes 503)
              ;; The request loop then ends the connection.
              (hunchentoot:header-out :connection) "Close")
        (hunchentoot:acceptor-log-access acceptor :return-code 503)
        (hunchentoot-headers-sent)))))

(defmethod hunchentoot:process-connection ((acceptor hunchentoot:acceptor)
                                            (socket connection-usocket))
  ;; A client that hangs up after its answer was written into the buffer
  ;; makes the last FINISH-OUTPUT fail outside any request; the error would
  ;; reach the log wrapped in usocket conditions.  Count it instead
  ;; (GALLOP:STATS :ABORTED), like the errors inside a request (see
  ;; ACCEPTOR-LOG-MESSAGE in taskmaster.lisp).  A stop's cut is logged as
  ;; one (NOTE-REQUEST-CUT), not as an error.
  (block serve
    (handler-bind ((gallop.core:connection-error
                     (lambda (condition)
                       (when (client-abort-condition-p condition)
                         (gallop.core:note-client-abort
                          (gallop.core:connection-engine (usocket-connection socket)))
                         (return-from serve nil))))
                   ((or handler-timeout usocket:unknown-error)
                     (lambda (condition)
                       (when (stop-cut-condition-p condition)
                         (note-request-cut acceptor)
                         (return-from serve nil)))))
      (serve-requests acceptor socket))))
