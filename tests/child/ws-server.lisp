;;;; ws-server.lisp -- the WebSocket libraries users run on Hunchentoot and
;;;; Clack, unchanged, on Gallop, in a child process, so that what they load
;;;; stays out of the test image.  ASDF finds them as it would for the user:
;;;; a Quicklisp or source registry (CL_SOURCE_REGISTRY); the test that runs
;;;; this skips when they are absent (WITH-WS-CHILD).
;;;;
;;;;   sbcl ... --eval '(push (uiop:getcwd) asdf:*central-registry*)' \
;;;;        --load tests/child/ws-server.lisp
;;;;
;;;; Serves on 127.0.0.1, each on a free port:
;;;;   clack       websocket-driver's README echo app at /echo and a broadcast
;;;;               chat at /chat, under (clack:clackup ... :server :gallop);
;;;;               anything else: 200 "plain";
;;;;   easy        hunchensocket's README chat (rooms /bongo and /fury), and an
;;;;               echo at /echo for the WebSocket corpus, on an
;;;;               acceptor of hunchensocket's and GALLOP:EASY-ACCEPTOR's
;;;;               classes; /plain: 200 "plain" (an easy handler);
;;;;   taskmaster  the same chat on a stock HUNCHENSOCKET:WEBSOCKET-ACCEPTOR
;;;;               with a GALLOP:TASKMASTER;
;;;;   capped      the easy one again, with :MAX-SWITCHED-THREADS 2.
;;;; Prints "READY <clack> <easy> <taskmaster> <capped>" once all listen; then reads
;;;; commands: "fds" prints the count of open fds; "quit" or end of file
;;;; exits.

(load (merge-pathnames "protocol.lisp" *load-truename*))
(defpackage #:gallop-ws-server (:use #:common-lisp #:gallop-child))
(in-package #:gallop-ws-server)

(handler-bind ((warning #'muffle-warning))
  (asdf:load-system "clack")
  (asdf:load-system "websocket-driver")
  (asdf:load-system "clack-handler-gallop")
  (asdf:load-system "hunchensocket")
  (asdf:load-system "gallop"))

(defun free-ports (n)
  "N distinct ports no socket listens on now: all held open while the
kernel picks them, so that it cannot hand out one twice."
  (let ((sockets (loop repeat n
                       collect (usocket:socket-listen "127.0.0.1" 0 :reuse-address t))))
    (prog1 (mapcar #'usocket:get-local-port sockets)
      (mapc #'usocket:socket-close sockets))))

(defvar *ports* (free-ports 4)
  "The ports of the four servers below.  (Clack's server binds its port in
a thread of its own, later: a port picked after CLACKUP returns could be
the same one.)")

;;; websocket-driver, its README's echo app, and a chat

(defvar *chat* '())
(defvar *chat-lock* (sb-thread:make-mutex :name "chat"))

(defun clack-app (env)
  (cond ((string= (getf env :path-info) "/echo")
         (let ((ws (wsd:make-server env)))
           (wsd:on :message ws (lambda (message) (wsd:send ws message)))
           (lambda (responder) (declare (ignore responder)) (wsd:start-connection ws))))
        ((string= (getf env :path-info) "/chat")
         (let ((ws (wsd:make-server env)))
           (wsd:on :open ws (lambda ()
                              (sb-thread:with-mutex (*chat-lock*) (push ws *chat*))))
           (wsd:on :message ws (lambda (message)
                                 (dolist (peer (sb-thread:with-mutex (*chat-lock*)
                                                 (copy-list *chat*)))
                                   (wsd:send peer message))))
           (wsd:on :close ws (lambda (&key code reason)
                               (declare (ignore code reason))
                               (sb-thread:with-mutex (*chat-lock*)
                                 (setf *chat* (remove ws *chat*)))))
           (lambda (responder) (declare (ignore responder)) (wsd:start-connection ws))))
        (t '(200 (:content-type "text/plain") ("plain")))))

;;; hunchensocket's README chat, word for word

(defclass chat-room (hunchensocket:websocket-resource)
  ((name :initarg :name :initform (error "Name this room!") :reader name))
  (:default-initargs :client-class 'user))

(defclass user (hunchensocket:websocket-client)
  ((name :initarg :user-agent :reader name :initform (error "Name this user!"))))

(defvar *chat-rooms* (list (make-instance 'chat-room :name "/bongo")
                           (make-instance 'chat-room :name "/fury")))

(defun find-room (request)
  (find (hunchentoot:script-name request) *chat-rooms* :test #'string= :key #'name))

(pushnew 'find-room hunchensocket:*websocket-dispatch-table*)

(defun broadcast (room message &rest args)
  (loop for peer in (hunchensocket:clients room)
        do (hunchensocket:send-text-message peer (apply #'format nil message args))))

(defmethod hunchensocket:client-connected ((room chat-room) user)
  (broadcast room "~a has joined ~a" (name user) (name room)))

(defmethod hunchensocket:client-disconnected ((room chat-room) user)
  (broadcast room "~a has left ~a" (name user) (name room)))

(defmethod hunchensocket:text-message-received ((room chat-room) user message)
  (broadcast room "~a says ~a" (name user) message))

;;; An echo on hunchensocket, for the WebSocket corpus (its default limits:
;;; binary messages refused, 64 KiB fragments, 1 MiB messages).

(defclass echo-resource (hunchensocket:websocket-resource) ())
(defvar *echo* (make-instance 'echo-resource))
(pushnew (lambda (request) (and (string= (hunchentoot:script-name request) "/echo") *echo*))
         hunchensocket:*websocket-dispatch-table*)
(defmethod hunchensocket:text-message-received ((resource echo-resource) client message)
  (hunchensocket:send-text-message client message))
(defmethod hunchensocket:binary-message-received ((resource echo-resource) client message)
  (hunchensocket:send-binary-message client message))

;;; The one line a user changes: the acceptor's class, or its taskmaster.

(defclass easy-websocket-acceptor (hunchensocket:websocket-acceptor gallop:easy-acceptor) ())

(hunchentoot:define-easy-handler (plain :uri "/plain") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "plain")

(defvar *clack-port* (first *ports*))
(defvar *clack-thread*
  (clack:clackup #'clack-app :server :gallop :address "127.0.0.1" :port *clack-port*
                             :use-thread t :silent t :debug nil))

(defun port-open-p (port)
  (handler-case (progn (usocket:socket-close (usocket:socket-connect "127.0.0.1" port)) t)
    (error () nil)))

(loop repeat 200 until (port-open-p *clack-port*) do (sleep 0.05))

(defvar *easy*
  (hunchentoot:start (make-instance 'easy-websocket-acceptor
                                    :address "127.0.0.1" :port (second *ports*)
                                    :access-log-destination nil
                                    :message-log-destination *error-output*)))

(defvar *taskmaster*
  (hunchentoot:start (make-instance 'hunchensocket:websocket-acceptor
                                    :address "127.0.0.1" :port (third *ports*)
                                    :taskmaster (make-instance 'gallop:taskmaster)
                                    :access-log-destination nil
                                    :message-log-destination *error-output*)))

(defvar *capped*
  (hunchentoot:start (make-instance 'easy-websocket-acceptor
                                    :address "127.0.0.1" :port (fourth *ports*)
                                    :taskmaster (make-instance 'gallop:taskmaster
                                                               :max-switched-threads 2)
                                    :access-log-destination nil
                                    :message-log-destination *error-output*)))

(reply "READY ~D ~D ~D ~D" *clack-port* (hunchentoot:acceptor-port *easy*)
       (hunchentoot:acceptor-port *taskmaster*) (hunchentoot:acceptor-port *capped*))

(loop for line = (read-line *standard-input* nil)
      for command = (and line (string-trim " " line))
      while (and command (string/= command "quit"))
      do (cond ((string= command "fds")
                (reply "~D" (length (directory "/proc/self/fd/*" :resolve-symlinks nil))))))

(hunchentoot:stop *easy*)
(hunchentoot:stop *taskmaster*)
(hunchentoot:stop *capped*)
(clack:stop *clack-thread*)
(sb-ext:exit :abort t)
