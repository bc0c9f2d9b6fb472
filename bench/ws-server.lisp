;;;; ws-server.lisp -- a WebSocket server of `make bench-websockets`, one
;;;; kind per process, on 127.0.0.1:PORT:
;;;;
;;;;   scripts/lisp.sh --load bench/ws-server.lisp --end-toplevel-options KIND PORT
;;;;
;;;; KIND: native (GALLOP:ACCEPT-WEBSOCKET on GALLOP:START), wsd-gallop
;;;; (websocket-driver under Clack :gallop), hs-gallop (hunchensocket on an
;;;; acceptor of its class and GALLOP:EASY-ACCEPTOR's), hs-stock (hunchensocket
;;;; on stock Hunchentoot, its default taskmaster; bench/ws-server-hs.lisp).  ASDF finds
;;;; the libraries as it would for a user (Quicklisp, or CL_SOURCE_REGISTRY);
;;;; a kind whose libraries it does not find fails to start, and its row
;;;; says so.  Each serves /echo (each message back to its
;;;; sender), /all (each message to every WebSocket on /all) and /plain (200
;;;; "plain").  Prints "READY <pid>"; then reads commands: "gc" -> a full
;;;; GC, then "GC"; "stats" -> "STATS <plist>" (Gallop's, or NIL); end of
;;;; file -> exit.

(defpackage #:gallop-bench-ws-server (:use #:common-lisp))
(in-package #:gallop-bench-ws-server)

(defvar *protocol* sb-sys:*stdout*)
(setf *standard-output* *error-output*)

(defvar *kind* (intern (string-upcase (second sb-ext:*posix-argv*)) :keyword))
(defvar *port* (parse-integer (third sb-ext:*posix-argv*)))

(if (eq *kind* :native)
    (asdf:load-system "gallop/native")
    (progn
      (handler-bind ((warning #'muffle-warning))
        (if (member *kind* '(:wsd-gallop))
            (progn (asdf:load-system "clack") (asdf:load-system "websocket-driver")
                   (asdf:load-system "clack-handler-gallop"))
            (progn (asdf:load-system "hunchensocket")
                   (when (eq *kind* :hs-gallop) (asdf:load-system "gallop")))))))

(defun sym (name package) (find-symbol (string-upcase name) package))
(defun call (name package &rest args) (apply (sym name package) args))

(defvar *all* '())
(defvar *lock* (sb-thread:make-mutex :name "all"))
(defun everyone () (sb-thread:with-mutex (*lock*) (copy-list *all*)))
(defun join (x) (sb-thread:with-mutex (*lock*) (push x *all*)))
(defun leave (x) (sb-thread:with-mutex (*lock*) (setf *all* (remove x *all*))))

(defvar *server* nil)

(defun plain () '(200 (:content-type "text/plain") ("plain")))

(ecase *kind*
  (:native
   (setf *server*
         (call "start" "GALLOP"
               (lambda (env)
                 (let ((path (getf env :path-info)))
                   (cond ((and (string= path "/echo") (call "websocket-request-p" "GALLOP" env))
                          (call "accept-websocket" "GALLOP" env
                                :on-message (lambda (ws m) (call "ws-send" "GALLOP" ws m))))
                         ((and (string= path "/all") (call "websocket-request-p" "GALLOP" env))
                          (call "accept-websocket" "GALLOP" env
                                :on-open #'join
                                :on-message (lambda (ws m) (declare (ignore ws))
                                              (dolist (peer (everyone)) (call "ws-send" "GALLOP" peer m)))
                                :on-close (lambda (ws code reason) (declare (ignore code reason))
                                            (leave ws))))
                         (t (plain)))))
               :address "127.0.0.1" :port *port* :log nil)))
  (:wsd-gallop
   (setf *server*
         (call "clackup" "CLACK"
               (lambda (env)
                 (let ((path (getf env :path-info)))
                   (if (member path '("/echo" "/all") :test #'string=)
                       (let ((ws (call "make-server" "WEBSOCKET-DRIVER" env)))
                         (if (string= path "/echo")
                             (call "on" "WEBSOCKET-DRIVER" :message ws
                                   (lambda (m) (call "send" "WEBSOCKET-DRIVER" ws m)))
                             (progn
                               (call "on" "WEBSOCKET-DRIVER" :open ws (lambda () (join ws)))
                               (call "on" "WEBSOCKET-DRIVER" :close ws
                                     (lambda (&key code reason) (declare (ignore code reason)) (leave ws)))
                               (call "on" "WEBSOCKET-DRIVER" :message ws
                                     (lambda (m) (dolist (peer (everyone))
                                                   (call "send" "WEBSOCKET-DRIVER" peer m))))))
                         (lambda (responder) (declare (ignore responder))
                           (call "start-connection" "WEBSOCKET-DRIVER" ws)))
                       (plain))))
               :server :gallop :address "127.0.0.1" :port *port* :use-thread t :silent t :debug nil)))
  ((:hs-gallop :hs-stock)
   ;; Read once hunchensocket is loaded: its symbols are named there.
   (load (merge-pathnames "ws-server-hs.lisp" *load-truename*))
   (setf *server* (call "start-hunchensocket" "GALLOP-BENCH-WS-SERVER" *kind* *port*))))

(defun reply (control &rest args)
  (let ((*print-pretty* nil)) (format *protocol* "~?~%" control args))
  (finish-output *protocol*))

(reply "READY ~D" (sb-unix:unix-getpid))

(loop for line = (read-line *standard-input* nil)
      while line
      do (let ((command (string-trim " " line)))
           (cond ((string= command "gc") (sb-ext:gc :full t) (reply "GC"))
                 ((string= command "stats")
                  (reply "STATS ~S"
                         (ignore-errors
                          (let ((stats (sym "stats" "GALLOP")))
                            (and stats (eq *kind* :native) (funcall stats *server*)))))))))
(sb-ext:exit :abort t)
