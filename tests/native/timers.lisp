;;;; timers.lisp -- GALLOP:AFTER and GALLOP:CANCEL-TIMER (src/core/timers.lisp):
;;;; requests answered later by a timer hold no thread; a cancelled timer
;;;; never runs; timers are usable from a Hunchentoot handler and from any
;;;; thread with :SERVER.

(in-package #:gallop-tests)

(in-suite native)

(defparameter *pending-requests* 2000)

(defun delayed-app (env)
  "Answers every request 1 s later, from a timer: the body is the
milliseconds that passed between the request and the answer, on the precise
monotonic clock (GET-INTERNAL-REAL-TIME may be the coarse one, a few ms
behind)."
  (declare (ignore env))
  (let ((start (gallop.core::now-us)))
    (lambda (responder)
      (gallop:after 1 (lambda ()
                        (let ((ms (floor (- (gallop.core::now-us) start) 1000)))
                          (funcall responder (list 200 '(:content-type "text/plain")
                                                   (list (princ-to-string ms))))))))))

(test pending-requests-answered-by-timers-hold-no-thread
  (gallop.core:raise-fd-limit (+ 1000 (* 3 *pending-requests*)))
  (with-app (server #'delayed-app :standby-thread-count 4)
    (let ((sockets '())
          (most-threads 0))
      (unwind-protect
           (progn
             (dotimes (i *pending-requests*)
               (let ((socket (connect (native-port server))))
                 (push socket sockets)
                 (send socket (crlf "GET /later HTTP/1.1" "Host: x"))))
             ;; While they wait, the pool keeps its threads: sampled until
             ;; every request was answered.
             (is (wait-until (lambda ()
                               (let ((s (gallop:stats server)))
                                 (setf most-threads (max most-threads (getf s :threads)))
                                 (and (zerop (getf s :in-flight)) (zerop (getf s :timers)))))
                             :timeout 30)
                 "not all answered: ~S" (gallop:stats server))
             (is (<= most-threads (+ 4 4)) "the pool grew to ~D threads" most-threads)
             (let ((good 0) (early 0))
               (dolist (socket sockets)
                 (let ((response (read-wire-or-error socket :persistent t)))
                   (when (and (typep response 'wire-response) (= 200 (wire-status response))
                              (equal (princ-to-string (length (wire-body response)))
                                     (wire-header response "Content-Length")))
                     (incf good)
                     (when (< (parse-integer (wire-body-string response)) 1000)
                       (incf early)))))
               (is (= *pending-requests* good) "~D of ~D answered exactly" good *pending-requests*)
               (is (zerop early) "~D answered before their timer's second" early)))
        (mapc #'usocket:socket-close sockets)))
    (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open)))))))

(test a-cancelled-timer-never-runs
  (let ((results (sb-concurrency:make-mailbox)))
    (flet ((app (env)
             (declare (ignore env))
             (lambda (responder)
               (let ((early (gallop:after 0.1 (lambda ()
                                                (funcall responder '(200 (:content-type "text/plain")
                                                                     ("cancelled timer")))))))
                 (sb-concurrency:send-message results (gallop:cancel-timer early))
                 (sb-concurrency:send-message results (gallop:cancel-timer early))
                 (gallop:after 0.3 (lambda ()
                                     (funcall responder '(200 (:content-type "text/plain")
                                                          ("second timer")))))))))
      (with-app (server #'app)
        (let ((response (get-request (native-port server) "/")))
          (is (= 200 (response-status response)))
          (is (equal "second timer" (body-string response)))
          (is (equal "12" (header response "Content-Length"))))
        (is (eq t (sb-concurrency:receive-message results :timeout 5)) "the first cancel")
        (is (null (sb-concurrency:receive-message results :timeout 5)) "the second cancel")
        (is (zerop (getf (gallop:stats server) :timers)))))))

(defvar *timer-mailbox* nil)

(test timers-from-a-hunchentoot-handler-and-from-any-thread
  (let ((fired (sb-concurrency:make-mailbox)))
    (with-globals ((*timer-mailbox* fired))
      (with-server (server 'gallop:easy-acceptor)
        ;; In a handler: its own server's pool.
        (let ((response (get-request (port-of server) "/set-timer")))
          (is (= 200 (response-status response)))
          (is (equal "set" (body-string response))))
        (is (equal "from the handler" (sb-concurrency:receive-message fired :timeout 5)))
        ;; From this thread, which is no worker: :SERVER says where.
        (signals error (gallop:after 0 (lambda ())))
        (let ((timer (gallop:after 0.05 (lambda ()
                                          (sb-concurrency:send-message
                                           fired (if (eq gallop.core:*worker-pool*
                                                         (gallop:server-pool server))
                                                     "on a worker of the server"
                                                     "elsewhere")))
                                   :server server)))
          (is (typep timer 'gallop.core:timer)))
        (is (equal "on a worker of the server" (sb-concurrency:receive-message fired :timeout 5)))))))

(hunchentoot:define-easy-handler (handle-set-timer :uri "/set-timer") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (gallop:after 0.05 (lambda () (sb-concurrency:send-message *timer-mailbox* "from the handler")))
  "set")
