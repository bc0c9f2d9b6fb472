;;;; listen.lisp -- listening sockets shared with other processes: several
;;;; servers on one port (SO_REUSEPORT), and sockets a supervisor passes
;;;; (systemd's socket activation), on both front ends.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: PARSE-LISTEN-ENVIRONMENT,
;;;; the pure reading of LISTEN_FDS, and the registry of passed sockets
;;;; (*ACTIVATED-SOCKETS*, os/listen.lisp), saved and restored around a test
;;;; that fakes a supervisor's sockets.

(in-package #:gallop-tests)

(def-suite production :in gallop
  :description "What running Gallop in production takes: shared ports, passed sockets.")

(in-suite production)

(test listen-environment-is-read-as-sd-listen-fds-reads-it
  "LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES pass fds 3, 4, ... to the
process named, and to no other (a child inherits the environment)."
  (flet ((parse (pid fds names)
           (gallop.core::parse-listen-environment pid fds names 4242)))
    (is (equal '((3 "web")) (parse "4242" "1" "web")))
    (is (equal '((3 "web") (4 "admin")) (parse "4242" "2" "web:admin")))
    (is (equal '((3 nil) (4 nil)) (parse "4242" "2" nil)) "no names")
    (is (equal '((3 nil) (4 nil)) (parse "4242" "2" "web")) "names that do not match the count")
    (is (null (parse "4243" "1" "web")) "another process's")
    (is (null (parse nil "1" nil)) "no LISTEN_PID")
    (is (null (parse "4242" "0" nil)))
    (is (null (parse "4242" "x" nil)))
    (is (null (parse "4242" nil nil)))))

;;; Two servers on one port

(defun native-hey (env)
  (declare (ignore env))
  '(200 (:content-type "text/plain") ("Hey!")))

(defun spread-over (port count)
  "COUNT requests on fresh connections to PORT; the answers, read strictly."
  (loop repeat count collect (strict-get port "/yo")))

(test reuse-port-lets-two-servers-share-a-port
  "Two servers started with :REUSE-PORT on the same port both get
connections (64 of them: all to one of the two would come by chance once in
2^63), and every request is answered; a third without it cannot bind."
  (flet ((check (start stop stats)
           (let* ((a (funcall start 0))
                  (port (funcall stats a :port))
                  (b nil))
             (unwind-protect
                  (progn
                    (setf b (funcall start port))
                    (let ((answers (spread-over port 64)))
                      (is (every (lambda (answer) (exact-answer-p answer "Hey!")) answers)
                          "~S" (find-if-not (lambda (answer) (exact-answer-p answer "Hey!"))
                                            answers)))
                    (let ((a-count (funcall stats a :accepted))
                          (b-count (funcall stats b :accepted)))
                      (is (= 64 (+ a-count b-count)) "~D + ~D" a-count b-count)
                      (is (plusp a-count))
                      (is (plusp b-count)))
                    (signals error (funcall stop (funcall start port :reuse-port nil))))
               (when b (funcall stop b))
               (funcall stop a)))))
    (check (lambda (port &key (reuse-port t))
             (gallop:start #'native-hey :port port :address "127.0.0.1" :log nil
                                        :reuse-port reuse-port))
           #'gallop:stop
           (lambda (server key)
             (if (eq key :port) (gallop:server-port server) (getf (gallop:stats server) key))))
    (check (lambda (port &key (reuse-port t))
             (hunchentoot:start (make-server 'gallop:easy-acceptor :port port
                                                                   :reuse-port reuse-port)))
           #'hunchentoot:stop
           (lambda (acceptor key)
             (if (eq key :port) (port-of acceptor) (stat acceptor key))))))

;;; A socket a supervisor passes

(defun make-passed-socket ()
  "A listening socket on 127.0.0.1 and a free port, as a supervisor makes
one (the port: its second value)."
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (setf (sb-bsd-sockets:sockopt-reuse-address socket) t)
    (sb-bsd-sockets:socket-bind socket #(127 0 0 1) 0)
    (sb-bsd-sockets:socket-listen socket 128)
    (values socket (nth-value 1 (sb-bsd-sockets:socket-name socket)))))

(defun start-activated-server (kind socket port)
  "bench/server.lisp serving KIND in a child process given SOCKET as a
supervisor passes it: as fd 3, with LISTEN_FDS, LISTEN_PID (the child's
own) and LISTEN_FDNAMES set.  PORT, the socket's port, is also the port the
child is asked to bind, which it could not: it serves only if it takes the
socket.  Returns the process once it says READY (or NIL), and that line.
The socket goes over as a copy numbered 10 or more (RUN-PROGRAM does not
keep a preserved fd 3), moved to 3 by bash (dash redirects only fds 0-9)."
  (let* ((fd (sb-posix:fcntl (sb-bsd-sockets:socket-file-descriptor socket)
                             sb-posix:f-dupfd 10))
         (script (format nil "exec 3<&~D ~:*~D<&-; export LISTEN_PID=$$ LISTEN_FDS=1 ~
                              LISTEN_FDNAMES=web; exec scripts/lisp.sh --load bench/server.lisp ~
                              --end-toplevel-options ~A ~D 0"
                         fd kind port)))
    (unwind-protect
         (let ((process (sb-ext:run-program "/bin/bash" (list "-c" script)
                                            :wait nil :input :stream :output :stream :error nil
                                            :preserve-fds (list fd)
                                            :directory (asdf:system-source-directory "gallop"))))
           (values process (read-line (sb-ext:process-output process) nil "")))
      (sb-posix:close fd))))

(test a-passed-socket-is-served-and-queues-connections-across-a-restart
  "A server given a listening socket the way systemd passes one serves on it
instead of binding, on both front ends.  While no server runs, the socket
(the supervisor's) still queues connections: a request sent then is
answered by the next server, and none is refused."
  (dolist (kind '("native" "gallop"))
    (multiple-value-bind (socket port) (make-passed-socket)
      (unwind-protect
           (multiple-value-bind (first ready) (start-activated-server kind socket port)
             (unwind-protect
                  (progn
                    (is (uiop:string-prefix-p "READY " ready) "~A: the first server said ~S"
                        kind ready)
                    (is (exact-answer-p (strict-get port "/yo") "Hey!") "~A: the first server"
                        kind))
               (stop-limited-server first))
             ;; No server: the client connects all the same, and waits.
             (let ((client (connect port)))
               (unwind-protect
                    (progn
                      (send client (crlf "GET /yo HTTP/1.1" "Host: x" "Connection: close"))
                      (multiple-value-bind (second ready) (start-activated-server kind socket port)
                        (unwind-protect
                             (progn
                               (is (uiop:string-prefix-p "READY " ready)
                                   "~A: the second server said ~S" kind ready)
                               (is (exact-answer-p (read-wire-or-error client :close t) "Hey!")
                                   "~A: the request sent between the two servers" kind))
                          (stop-limited-server second))))
                 (usocket:socket-close client))))
        (sb-bsd-sockets:socket-close socket)))))

(defmacro with-passed-sockets ((&rest sockets) &body body)
  "BODY with this process's passed sockets (listen.lisp) being SOCKETS,
each a list (SOCKET NAME), as if a supervisor had passed them."
  `(let ((saved (sb-thread:with-mutex (gallop.core::*activated-sockets-lock*)
                  (shiftf gallop.core::*activated-sockets*
                          (loop for (socket name) in (list ,@(mapcar (lambda (s) `(list ,@s))
                                                                     sockets))
                                collect (gallop.core::make-activated-socket
                                         (sb-bsd-sockets:socket-file-descriptor socket) name
                                         (nth-value 1 (sb-bsd-sockets:socket-name socket))))))))
     (unwind-protect (progn ,@body)
       (sb-thread:with-mutex (gallop.core::*activated-sockets-lock*)
         (setf gallop.core::*activated-sockets* saved)))))

(test a-passed-socket-is-taken-by-its-port-and-again-after-a-stop
  "A server takes the passed socket on the port it asks for, not one on
another port; it serves on a copy, so that stopped and started again in the
same process it serves on the socket again, on both front ends."
  (multiple-value-bind (socket port) (make-passed-socket)
    (unwind-protect
         (with-passed-sockets ((socket "web"))
           (flet ((check (start stop)
                    ;; Another port: not the passed socket, which stays free.
                    (let ((other (funcall start 0)))
                      (funcall stop other))
                    (dotimes (i 2)
                      (let ((server (funcall start port)))
                        (unwind-protect
                             (is (exact-answer-p (strict-get port "/yo") "Hey!")
                                 "run ~D of a server on the passed socket" i)
                          (funcall stop server))))))
             (check (lambda (port)
                      (gallop:start #'native-hey :port port :address "127.0.0.1" :log nil))
                    #'gallop:stop)
             (check (lambda (port)
                      (hunchentoot:start (make-server 'gallop:easy-acceptor :port port)))
                    #'hunchentoot:stop)
             (is (null (gallop.core:claim-activated-socket :name "other")))
             (let ((copy (gallop.core:claim-activated-socket :name "web")))
               (is (integerp copy) "the passed socket is free again after the stops")
               (when copy
                 (sb-posix:close copy)
                 (gallop.core:release-activated-socket copy)))))
      (sb-bsd-sockets:socket-close socket))))

(test a-server-asking-for-a-port-no-passed-socket-is-on-refuses-to-start
  "In a process given passed sockets, a server that asks for a port none of
them is on refuses to start, with a one-line error naming each passed
socket's address and port and the ones asked for, on both front ends
\(bound beside them, it would serve a port nobody connects to while the
supervisor's socket queues connections no one accepts).  Several servers
each on its own passed socket still serve at once, and so does a server
told :activated-socket nil on the other port."
  (multiple-value-bind (socket-a port-a) (make-passed-socket)
    (multiple-value-bind (socket-b port-b) (make-passed-socket)
      (unwind-protect
           (with-passed-sockets ((socket-a nil) (socket-b nil))
             (let ((other (free-port)))
               (flet ((check (kind start stop)
                        (let ((refusal (handler-case (progn (funcall stop (funcall start other t))
                                                            nil)
                                         (error (e) (princ-to-string e)))))
                          (is (stringp refusal) "~A: a server on port ~D started" kind other)
                          (when refusal
                            (is (not (find #\Newline refusal)) "~A: ~S" kind refusal)
                            (dolist (named (list (format nil "127.0.0.1:~D" other)
                                                 (format nil "127.0.0.1:~D" port-a)
                                                 (format nil "127.0.0.1:~D" port-b)))
                              (is (search named refusal) "~A: ~S does not name ~A"
                                  kind refusal named))))
                        (let ((a (funcall start port-a t))
                              (b nil)
                              (own nil))
                          (unwind-protect
                               (progn
                                 (setf b (funcall start port-b t)
                                       own (funcall start other nil))
                                 (dolist (port (list port-a port-b other))
                                   (is (exact-answer-p (strict-get port "/yo") "Hey!")
                                       "~A: the server on port ~D" kind port)))
                            (when own (funcall stop own))
                            (when b (funcall stop b))
                            (funcall stop a)))))
                 (check "native"
                        (lambda (port activated)
                          (gallop:start #'native-hey :port port :address "127.0.0.1" :log nil
                                                     :activated-socket activated))
                        #'gallop:stop)
                 (check "easy-acceptor"
                        (lambda (port activated)
                          (hunchentoot:start (make-server 'gallop:easy-acceptor
                                                          :port port
                                                          :activated-socket activated)))
                        #'hunchentoot:stop))))
        (sb-bsd-sockets:socket-close socket-b)
        (sb-bsd-sockets:socket-close socket-a)))))
