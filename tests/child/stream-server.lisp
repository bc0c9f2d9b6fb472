;;;; stream-server.lisp -- a Gallop server in a child process whose handlers
;;;; stream their answers, for the slow-read tests of tests/stress/slow-read.lisp.
;;;;
;;;;   scripts/lisp.sh --load tests/child/stream-server.lisp --end-toplevel-options KIND
;;;;
;;;; KIND is easy-acceptor (GALLOP:EASY-ACCEPTOR, the handler writing to the
;;;; stream SEND-HEADERS returns) or native (GALLOP:START, a streaming
;;;; writer).  Default settings.  It listens on 127.0.0.1 and a free port:
;;;;   GET /yo      -> 200, "Yo!"
;;;;   GET /stream  -> 200, 1 MiB streamed in 16 KiB writes (no Content-Length
;;;;                   on the native writer: chunked; Content-Length through
;;;;                   Hunchentoot), each write a fresh copy of the same octets
;;;; and talks to the test on standard input/output:
;;;;   prints "READY <port>" once it listens;
;;;;   "stats" -> "STATS <plist>" (GALLOP:STATS);
;;;;   "quit" or end of file -> exits.

(load (merge-pathnames "protocol.lisp" *load-truename*))
(defpackage #:gallop-stream-server (:use #:common-lisp #:gallop-child))
(in-package #:gallop-stream-server)

(defvar *kind* (child-kind))

(asdf:load-system (if (eq *kind* :native) "gallop/native" "gallop"))

(defconstant +piece+ (* 16 1024))
(defconstant +pieces+ 64)

(defvar *piece*
  (let ((v (make-array +piece+ :element-type '(unsigned-byte 8))))
    (dotimes (i +piece+ v) (setf (aref v i) (mod (* 7 i) 251))))
  "What each write of /stream writes.")

(defun native-app (env)
  (if (string= (getf env :path-info) "/stream")
      (lambda (respond)
        (let ((write (funcall respond '(200 (:content-type "application/octet-stream")))))
          (loop repeat +pieces+
                while (funcall write *piece*))
          (funcall write nil :close t)))
      '(200 (:content-type "text/plain") ("Yo!"))))

(defun hunchentoot-handler ()
  (let ((request (symbol-value (find-symbol "*REQUEST*" "HUNCHENTOOT"))))
    (if (string= (funcall (find-symbol "SCRIPT-NAME*" "HUNCHENTOOT") request) "/stream")
        (progn
          (funcall (fdefinition (list 'setf (find-symbol "CONTENT-TYPE*" "HUNCHENTOOT")))
                   "application/octet-stream")
          (funcall (fdefinition (list 'setf (find-symbol "CONTENT-LENGTH*" "HUNCHENTOOT")))
                   (* +piece+ +pieces+))
          (let ((out (funcall (find-symbol "SEND-HEADERS" "HUNCHENTOOT"))))
            (loop repeat +pieces+
                  do (write-sequence *piece* out))
            (finish-output out))
          nil)
        (progn
          (funcall (fdefinition (list 'setf (find-symbol "CONTENT-TYPE*" "HUNCHENTOOT")))
                   "text/plain")
          "Yo!"))))

(defvar *server*
  (ecase *kind*
    (:native
     (gallop:start #'native-app :address "127.0.0.1" :port 0 :log *error-output*))
    (:easy-acceptor
     (let ((acceptor (make-instance (find-symbol "EASY-ACCEPTOR" "GALLOP")
                                    :address "127.0.0.1" :port 0
                                    :access-log-destination nil
                                    :message-log-destination *error-output*)))
       (setf (symbol-value (find-symbol "*DISPATCH-TABLE*" "HUNCHENTOOT"))
             (list (lambda (request) (declare (ignore request)) #'hunchentoot-handler)))
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
                 ((string= command "quit") (return)))))

(sb-ext:exit :code 0 :abort t)
