;;;; ws-server-hs.lisp -- hunchensocket's part of bench/ws-server.lisp,
;;;; loaded once hunchensocket is: /echo and /all as resources, /plain as a
;;;; plain answer, on stock Hunchentoot (hs-stock) or on Gallop (hs-gallop).

(in-package #:gallop-bench-ws-server)

(defclass ws-room (hunchensocket:websocket-resource)
  ((name :initarg :name :reader name)))

(defvar *rooms* (list (make-instance 'ws-room :name "/echo") (make-instance 'ws-room :name "/all")))

(pushnew (lambda (request)
           (find (hunchentoot:script-name request) *rooms* :test #'string= :key #'name))
         hunchensocket:*websocket-dispatch-table*)

(defmethod hunchensocket:text-message-received ((room ws-room) client message)
  (if (string= (name room) "/echo")
      (hunchensocket:send-text-message client message)
      (dolist (peer (hunchensocket:clients room))
        (hunchensocket:send-text-message peer message))))

(defclass plain-acceptor (hunchensocket:websocket-acceptor) ())

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor plain-acceptor) request)
  (if (string= (hunchentoot:script-name request) "/plain")
      (progn (setf (hunchentoot:content-type*) "text/plain") "plain")
      (call-next-method)))

(defun start-hunchensocket (kind port)
  (let ((class (if (eq kind :hs-stock)
                   'plain-acceptor
                   (progn (eval `(defclass gallop-plain-acceptor
                                     (plain-acceptor ,(find-symbol "EASY-ACCEPTOR" "GALLOP"))
                                   ()))
                          'gallop-plain-acceptor))))
    (hunchentoot:start (make-instance class :address "127.0.0.1" :port port
                                            :access-log-destination nil
                                            :message-log-destination nil))))
