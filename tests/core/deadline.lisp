;;;; deadline.lisp -- the per-request handler deadline (:HANDLER-TIMEOUT) and
;;;; the hard stop's interruption of handlers that never return, through each
;;;; layer: the native API, GALLOP:EASY-ACCEPTOR, and GALLOP:TASKMASTER on a
;;;; stock acceptor.

(in-package #:gallop-tests)

(in-suite core)

(defvar *stuck-unwound* 0
  "How many stuck handlers were unwound (their UNWIND-PROTECT cleanup ran).")
(defvar *stuck-finished* 0
  "How many stuck handlers ran to their end: none should.")

(defun stuck-handler-body ()
  "What a handler that never returns does: swallow every ERROR while it
sleeps, for longer than any test waits."
  (unwind-protect
       (progn (ignore-errors (sleep 60))
              (incf *stuck-finished*))
    (incf *stuck-unwound*)))

(defun spinning-handler-body ()
  "A handler that computes forever, catching every ERROR."
  (unwind-protect
       (loop (handler-case (loop repeat 100000 count (evenp (random 7)))
               (error () nil)))
    (incf *stuck-unwound*)))

(hunchentoot:define-easy-handler (handle-stuck :uri "/stuck") ()
  (stuck-handler-body)
  "never")

(defun deadline-app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/stuck") (stuck-handler-body) '(200 nil ("never")))
          ((string= path "/spin") (spinning-handler-body) '(200 nil ("never")))
          (t '(200 (:content-type "text/plain") ("ok"))))))

(defun expect-503-and-close (port path)
  "Send GET PATH on a new connection: true when the answer is 503 and the
server then closes the connection."
  (let ((socket (connect port :timeout 20)))
    (unwind-protect
         (progn
           (send socket (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x"))
           (let ((response (read-response socket)))
             (and response
                  (= 503 (response-status response))
                  (closed-by-peer-p socket))))
      (usocket:socket-close socket))))

(test native-handler-past-its-deadline-gets-503-and-the-server-serves-on
  (with-globals ((*stuck-unwound* 0) (*stuck-finished* 0))
    (let ((log (make-string-output-stream)))
      (with-app (server #'deadline-app :handler-timeout 0.5 :log log)
        (is (expect-503-and-close (native-port server) "/stuck"))
        (is (expect-503-and-close (native-port server) "/spin"))
        (is (= 200 (response-status (get-request (native-port server) "/ok"))))
        (is (wait-until (lambda () (zerop (getf (gallop:stats server) :in-flight)))))
        (is (= 2 *stuck-unwound*))
        (is (= 0 *stuck-finished*)))
      ;; Logged once each.
      (is (= 2 (count-matches "deadline" (get-output-stream-string log)))))))

(test a-deadline-covers-one-request-not-the-connection
  ;; Fast requests on one keep-alive connection, with pauses longer than the
  ;; deadline between them: none is cut, the connection stays open.
  ;; The deadline is long enough for a GC or a preempted worker (the
  ;; requests take microseconds), the pauses longer.
  (with-app (server #'deadline-app :handler-timeout 1)
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (dotimes (i 3)
             (send socket (crlf "GET /ok HTTP/1.1" "Host: x"))
             (let ((response (read-response socket)))
               (is (and response (= 200 (response-status response))))
               (is (equal "ok" (and response (body-string response)))))
             (sleep 1.5))
        (usocket:socket-close socket)))))

(test easy-acceptor-handler-past-its-deadline-gets-503
  (with-globals ((*stuck-unwound* 0) (*stuck-finished* 0))
    (let ((log (make-string-output-stream)))
      (with-server (server 'gallop:easy-acceptor
                           :taskmaster (make-instance 'gallop:taskmaster :handler-timeout 0.5)
                           :message-log-destination log)
        (is (expect-503-and-close (port-of server) "/stuck"))
        (is (= 200 (response-status (get-request (port-of server) "/yo"))))
        (is (wait-until (lambda () (zerop (stat server :in-flight)))))
        (is (= 1 *stuck-unwound*))
        (is (= 0 *stuck-finished*)))
      (is (= 1 (count-matches "deadline" (get-output-stream-string log)))))))

(test taskmaster-on-a-stock-acceptor-handler-past-its-deadline-gets-503
  (with-globals ((*stuck-unwound* 0) (*stuck-finished* 0))
    (with-server (server 'hunchentoot:easy-acceptor
                         :taskmaster (make-instance 'gallop:taskmaster :handler-timeout 0.5))
      (is (expect-503-and-close (port-of server) "/stuck"))
      (is (= 200 (response-status (get-request (port-of server) "/yo"))))
      (is (wait-until (lambda () (zerop (stat server :in-flight)))))
      (is (= 1 *stuck-unwound*)))))

(test hard-stop-interrupts-a-handler-that-never-returns
  ;; No deadline: the stop itself gives up on the handler after its grace.
  (with-globals ((*stuck-unwound* 0) (*stuck-finished* 0))
    (let ((threads (sb-thread:list-all-threads))
          (server (make-server 'gallop:easy-acceptor))
          (socket nil))
      (hunchentoot:start server)
      (unwind-protect
           (progn
             (setf socket (connect (port-of server)))
             (send socket (crlf "GET /stuck HTTP/1.1" "Host: x"))
             (is (wait-until (lambda () (= 1 (stat server :in-flight)))))
             (hunchentoot:stop server)
             (is (= 1 *stuck-unwound*))
             (is (= 0 *stuck-finished*))
             (is (no-threads-left-p threads) "threads left: ~S" (threads-started-since threads)))
        (when socket (usocket:socket-close socket))
        (when (hunchentoot:started-p server) (hunchentoot:stop server))))))
