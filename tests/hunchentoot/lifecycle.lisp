;;;; lifecycle.lisp -- start, stop (soft and hard), and what stopping leaves.

(in-package #:gallop-tests)

(def-suite lifecycle :in gallop :description "Starting and stopping.")
(in-suite lifecycle)

(test soft-stop-waits-for-the-request-in-flight
  (with-globals ((*sleep-seconds* 1) (*entered* (sb-thread:make-semaphore)))
   (let ((server (make-server 'gallop:easy-acceptor))
         (response nil))
    (hunchentoot:start server)
    (let ((client (sb-thread:make-thread
                   (lambda () (setf response (get-request (port-of server) "/sleep"))))))
      (is (sb-thread:wait-on-semaphore *entered* :timeout 10))
      (hunchentoot:stop server :soft t)
      (sb-thread:join-thread client)
      (is (response-p response))
      (is (= 200 (response-status response)))
      (is (string= "slept" (body-string response)))
      (is (not (hunchentoot:started-p server)))))))

(test stop-closes-idle-connections-and-frees-the-port
  (let* ((server (make-server 'gallop:easy-acceptor))
         (port nil))
    (hunchentoot:start server)
    (setf port (port-of server))
    (let ((idle (loop repeat 10 collect (connect port))))
      (unwind-protect
           (progn
             (dolist (socket idle)
               (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))
               (is (= 200 (response-status (read-response socket)))))
             (is (wait-until (lambda () (= 10 (stat server :idle)))))
             (hunchentoot:stop server)
             (is (every #'closed-by-peer-p idle)))
        (mapc #'usocket:socket-close idle)))
    ;; The port can be bound again at once.
    (let ((again (make-instance 'gallop:easy-acceptor :address "127.0.0.1" :port port
                                                      :access-log-destination nil
                                                      :message-log-destination nil)))
      (hunchentoot:start again)
      (unwind-protect (is (= 200 (response-status (get-request port "/yo"))))
        (hunchentoot:stop again)))))

(defun one-cycle (class &rest initargs)
  ;; The soft stop keeps the idle connection for its STOP-IDLE-GRACE, a
  ;; second by default: shorter here, twenty-five times.
  (let ((server (apply #'make-server class
                       (append initargs
                               (list :taskmaster (make-instance 'gallop:taskmaster
                                                                :stop-idle-grace 0.05))))))
    (hunchentoot:start server)
    (unwind-protect
         (progn
           (assert (= 200 (response-status (get-request (port-of server) "/yo"))))
           (let ((socket (connect (port-of server))))
             ;; leave one keep-alive connection open across the stop
             (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))
             (read-response socket)
             (hunchentoot:stop server :soft t)
             (usocket:socket-close socket)))
      (when (hunchentoot:started-p server) (hunchentoot:stop server)))))

(test twenty-start-stop-cycles-leak-no-thread-and-no-fd
  (one-cycle 'gallop:easy-acceptor)       ; warm up lazily created resources
  (let ((threads (sb-thread:list-all-threads))
        (fds (fd-count)))
    (dotimes (i 20)
      (one-cycle 'gallop:easy-acceptor))
    (dotimes (i 5)
      (one-cycle 'hunchentoot:easy-acceptor))
    (is (no-threads-left-p threads) "threads left: ~S" (threads-started-since threads))
    ;; An fd of an earlier test's stream may close meanwhile (its finalizer).
    (is (wait-until (lambda () (<= (fd-count) fds)) :timeout 5)
        "fds: ~D before, ~D after" fds (fd-count))))

(test hard-stop-returns-and-joins-its-threads
  (let ((threads (sb-thread:list-all-threads))
        (server (make-server 'gallop:easy-acceptor)))
    (hunchentoot:start server)
    (is (threads-started-since threads))
    (is (= 200 (response-status (get-request (port-of server) "/yo"))))
    (hunchentoot:stop server)
    ;; The stop joins them: none is left, not even one still exiting.
    (is (null (threads-started-since threads)) "threads left: ~S" (threads-started-since threads))))

;;; Hunchentoot counts requests in progress (a soft STOP waits for them) under
;;; the acceptor's shutdown lock; on Gallop the count is kept without it
;;; (src/hunchentoot/in-progress.lisp).

(defun requests-in-progress (acceptor)
  (slot-value acceptor (gallop::requests-in-progress-slot)))

(hunchentoot:define-easy-handler (handle-in-progress :uri "/in-progress") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (princ-to-string (requests-in-progress hunchentoot:*acceptor*)))

(test requests-in-progress-are-counted-without-the-acceptors-lock
  (with-globals ((*entered* (sb-thread:make-semaphore)) (*release* (sb-thread:make-semaphore)))
    (with-server (server 'gallop:easy-acceptor)
      ;; Served while another thread holds the lock (Hunchentoot's own count
      ;; would wait for it), and counted: the request itself is in progress.
      (let ((lock (hunchentoot::acceptor-shutdown-lock server))
            (response nil))
        (bt:with-lock-held (lock)
          (let ((socket (connect (port-of server) :timeout 5)))
            (unwind-protect
                 (progn (send socket (crlf "GET /in-progress HTTP/1.1" "Host: x"))
                        (setf response (handler-case (read-response socket)
                                         (sb-sys:io-timeout () :timeout))))
              (usocket:socket-close socket))))
        (is (response-p response) "no answer while the lock was held: ~S" response)
        (when (response-p response)
          (is (= 200 (response-status response)))
          (is (equal "1" (header response "Content-Length")))
          (is (equal "text/plain; charset=utf-8" (header response "Content-Type")))
          (is (string= "1" (body-string response)))))
      ;; Three at once are three in progress, and none once they are answered.
      (let* ((responses (make-array 3 :initial-element nil))
             (clients (loop for i below 3
                            collect (let ((i i))
                                      (sb-thread:make-thread
                                       (lambda ()
                                         (setf (aref responses i)
                                               (get-request (port-of server) "/sleep"))))))))
        (is (loop repeat 3 always (sb-thread:wait-on-semaphore *entered* :timeout 10)))
        (is (= 3 (requests-in-progress server)))
        (sb-thread:signal-semaphore *release* 3)
        (mapc #'sb-thread:join-thread clients)
        (loop for response across responses
              do (is (= 200 (response-status response)))
                 (is (string= "slept" (body-string response))))
        (is (wait-until (lambda () (zerop (requests-in-progress server)))))))))
