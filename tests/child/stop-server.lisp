;;;; stop-server.lisp -- a Gallop server in a child process, for tests that
;;;; need more connections than one process's fds allow for both ends.
;;;;
;;;;   scripts/lisp.sh --load tests/child/stop-server.lisp --end-toplevel-options KIND
;;;;
;;;; KIND is easy-acceptor (GALLOP:EASY-ACCEPTOR) or native (GALLOP:START).
;;;; It listens on 127.0.0.1 and a free port, answers every request with
;;;; "ok", and talks to the test on standard input/output:
;;;;   prints "READY <port>" once it listens;
;;;;   "stats" -> "STATS <plist>" (GALLOP:STATS);
;;;;   "stop"  -> stops the server (hard stop), then "STOPPED <milliseconds>";
;;;;   "quit" or end of file -> exits.

(load (merge-pathnames "protocol.lisp" *load-truename*))
(defpackage #:gallop-stop-server (:use #:common-lisp #:gallop-child))
(in-package #:gallop-stop-server)

(defvar *kind* (child-kind))

(asdf:load-system (if (eq *kind* :native) "gallop/native" "gallop"))

(defvar *server*
  (ecase *kind*
    (:native
     (gallop:start (lambda (env) (declare (ignore env)) '(200 (:content-type "text/plain") ("ok")))
                   :address "127.0.0.1" :port 0 :log nil :idle-timeout 120 :header-timeout 120))
    (:easy-acceptor
     (let ((acceptor (make-instance (find-symbol "EASY-ACCEPTOR" "GALLOP")
                                    :address "127.0.0.1" :port 0
                                    :access-log-destination nil :message-log-destination nil
                                    :taskmaster (make-instance (find-symbol "TASKMASTER" "GALLOP")
                                                               :idle-timeout 120
                                                               :header-timeout 120))))
       (setf (symbol-value (find-symbol "*DISPATCH-TABLE*" "HUNCHENTOOT"))
             (list (lambda (request) (declare (ignore request))
                     (lambda () "ok"))))
       (funcall (find-symbol "START" "HUNCHENTOOT") acceptor)))))

(defun port ()
  (if (eq *kind* :native)
      (gallop:server-port *server*)
      (funcall (find-symbol "ACCEPTOR-PORT" "HUNCHENTOOT") *server*)))

(reply "READY ~D" (port))

(loop for line = (read-line *standard-input* nil)
      while line
      do (let ((command (string-trim " " line)))
           (cond ((string= command "stats")
                  (reply "STATS ~S" (gallop:stats *server*)))
                 ((string= command "stop")
                  (let ((start (get-internal-real-time)))
                    (if (eq *kind* :native)
                        (gallop:stop *server*)
                        (funcall (find-symbol "STOP" "HUNCHENTOOT") *server*))
                    (reply "STOPPED ~D" (round (* 1000 (- (get-internal-real-time) start))
                                               internal-time-units-per-second))))
                 ((string= command "quit") (return)))))

(sb-ext:exit :code 0 :abort t)
