;;;; types.lisp -- the native layer's two structures: a running server, and
;;;; one request/response exchange on a connection.
;;;;
;;;; EXCHANGE-STATE is the hand-off between the worker that ran the app and a
;;;; thread that answers later: :OPEN while the worker is still in the app;
;;;; the first of "response complete" (:OPEN -> :DONE, the worker finishes the
;;;; connection) and "worker leaves" (:OPEN -> :SUSPENDED, the answering thread
;;;; finishes it) wins, by compare-and-swap.

(in-package #:gallop)

(defstruct (server (:constructor %make-server) (:copier nil))
  (app nil :type function)
  (engine nil)
  (socket nil)
  (address "127.0.0.1" :type string)
  (port 0 :type fixnum)
  (max-body-bytes 0 :type fixnum)
  (tls nil)                             ; its TLS context (GALLOP.CORE:MAKE-TLS-CONTEXT), when HTTPS
  (url-scheme "http" :type string)
  (debug nil)
  (log nil)
  (access-log nil)                      ; an ACCESS-LOG (access-log.lisp), or NIL
  (host-memo nil))                      ; the last Host read, see HOST-VALUE (request.lisp)

(defmethod print-object ((server server) stream)
  (print-unreadable-object (server stream :type t)
    (format stream "~A:~D" (server-address server) (server-port server))))

(defvar *log-lock* (sb-thread:make-mutex :name "gallop log")
  "Held while a line is written to a server's log, so that lines written by
two workers at once do not mix.")

(defun log-error (server format-control &rest args)
  "Write one line to SERVER's log, cut at GALLOP.CORE:+MAX-LOG-LINE+."
  (let ((log (server-log server)))
    (when log
      (ignore-errors
       (let ((line (gallop.core:format-log-line format-control args)))
         (sb-thread:with-mutex (*log-lock*)
           (format log "~&[gallop ~A] ~A~%" (iso-time) line)
           (finish-output log)))))))

(defun log-failure (server condition format-control &rest args)
  "Log (LOG-ERROR) that a request failed with CONDITION; when CONDITION is a
client's timeout, only if a line is due (GALLOP.CORE:TIMEOUT-LINE-DUE),
with the count of those not logged since the last."
  (if (typep condition 'gallop.core:connection-timeout-error)
      (let* ((engine (server-engine server))
             (skipped (if engine (gallop.core:timeout-line-due engine) 0)))
        (when skipped
          (log-error server "~?~[~:;~:* (and ~D more client timeouts in the last ~
                             minute, not logged)~]"
                     format-control args skipped)))
      (apply #'log-error server format-control args)))

(defun iso-time ()
  (multiple-value-bind (s m h day month year) (decode-universal-time (get-universal-time))
    (format nil "~D-~2,'0D-~2,'0D ~2,'0D:~2,'0D:~2,'0D" year month day h m s)))

(defstruct (exchange (:copier nil)
                     ;; Positional: one per request, and keyword parsing
                     ;; cost more than the rest of making it.
                     (:constructor make-exchange (connection server keep-alive http-1.0 head-p)))
  (connection nil)
  (server nil)
  (keep-alive t)
  (http-1.0 nil)
  (head-p nil)
  (state :open :type (member :open :responding :done :suspended)) ; see CLAIM, server.lisp
  (responded nil)
  (streaming nil)
  ;; For the access log only, taken before the app runs (which may change
  ;; its environment): the log, and the request's fields it writes.
  (access-log nil)
  (address nil)
  (method nil)
  (uri nil)
  (protocol nil)
  (agent nil)
  (referer nil)
  (authorization nil)
  ;; Once the app took the connection as a socket (socket.lisp):
  (read-callback nil)
  (close-callback nil)
  (websocket nil))                      ; it asked for a WebSocket

(defmethod print-object ((exchange exchange) stream)
  (print-unreadable-object (exchange stream :type t :identity t)))

