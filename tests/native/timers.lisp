;;;; timers.lisp -- GALLOP:AFTER and GALLOP:CANCEL-TIMER
;;;; (src/core/timers/timers.lisp): requests answered later by a timer hold
;;;; no thread; a cancelled timer never runs; timers are usable from a
;;;; Hunchentoot handler and from any thread with :SERVER.

(in-package #:gallop-tests)

(in-suite native)

(defparameter *pending-requests* 2000)

;;; (OPEN-REQUESTS: hunchentoot/pool.lisp.)

(defun delayed-app (env)
  "Answers every request 1 s later, from a timer: the body is the
milliseconds that passed between the request and the answer, on the precise
monotonic clock (GET-INTERNAL-REAL-TIME may be the coarse one, a few ms
behind)."
  (declare (ignore env))
  (let ((start (core-now-us)))
    (lambda (responder)
      (gallop:after 1 (lambda ()
                        (let ((ms (floor (- (core-now-us) start) 1000)))
                          (funcall responder (list 200 '(:content-type "text/plain")
                                                   (list (princ-to-string ms))))))))))

(defun wait-for-pending-answers (server)
  "Wait (at most 30 s, checked) until SERVER has no request in flight and no
timer pending; the most pool threads it had meanwhile (sampled)."
  (let ((most 0))
    (is (wait-until (lambda ()
                      (let ((s (gallop:stats server)))
                        (setf most (max most (getf s :threads)))
                        (and (zerop (getf s :in-flight)) (zerop (getf s :timers)))))
                    :timeout 30)
        "not all answered: ~S" (gallop:stats server))
    most))

(test a-cancelled-timer-never-runs
  (let ((results (sb-concurrency:make-mailbox)))
    (flet ((app (env)
             (declare (ignore env))
             (lambda (responder)
               ;; Far past the test: the cancel comes first however long
               ;; this worker is held up.
               (let ((early (gallop:after 60 (lambda ()
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
          ;; GALLOP:AFTER's value is the core's timer (timers/timers.lisp), a
          ;; type the core does not export: nothing names it but this test.
          (is (typep timer 'gallop.core::timer)))
        (is (equal "on a worker of the server" (sb-concurrency:receive-message fired :timeout 5)))))))

(hunchentoot:define-easy-handler (handle-set-timer :uri "/set-timer") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (gallop:after 0.05 (lambda () (sb-concurrency:send-message *timer-mailbox* "from the handler")))
  "set")

;;; A pending request whose client goes away is freed at once, not when its
;;; answer comes; one whose client sends its next request meanwhile is
;;; answered, then the next request is served.

(test a-pending-request-whose-client-resets-is-freed-at-once
  ;; (A client that only half-closes, FIN, may still read its answer: it
  ;; stays pending, see ABANDON-IF-GONE and the next test.)
  (dolist (how '(:reset))
    (let ((responders (sb-concurrency:make-mailbox))
          (log (make-string-output-stream)))
      (flet ((app (env)
               (declare (ignore env))
               (lambda (responder) (sb-concurrency:send-message responders responder))))
        (with-app (server #'app :log log)
          (let ((socket (connect (native-port server))))
            (send socket (crlf "GET /later HTTP/1.1" "Host: x"))
            (let ((responder (sb-concurrency:receive-message responders :timeout 5)))
              (is (wait-until (lambda () (eql 1 (getf (gallop:stats server) :suspended)))))
              (abort-connection socket how)
              (is (wait-until (lambda ()
                                (let ((s (gallop:stats server)))
                                  (and (zerop (getf s :open)) (eql 1 (getf s :abandoned))
                                       (zerop (getf s :suspended)) (zerop (getf s :in-flight))))))
                  "~A: not freed: ~S" how (gallop:stats server))
              ;; The answer comes later: NIL, and nothing is counted twice.
              (is (null (funcall responder '(200 (:content-type "text/plain") ("late")))))
              (let ((s (gallop:stats server)))
                (is (zerop (getf s :in-flight)) "~S" s)
                (is (zerop (getf s :suspended)) "~S" s)))))
        (is (zerop (length (get-output-stream-string log))))))))

(test a-pending-request-whose-client-half-closes-still-gets-its-answer
  (let ((responders (sb-concurrency:make-mailbox)))
    (flet ((app (env)
             (declare (ignore env))
             (lambda (responder) (sb-concurrency:send-message responders responder))))
      (with-app (server #'app)
        (let ((socket (connect (native-port server))))
          (unwind-protect
               (progn
                 (send socket (crlf "GET /later HTTP/1.1" "Host: x"))
                 (let ((responder (sb-concurrency:receive-message responders :timeout 5)))
                   (is (wait-until (lambda () (eql 1 (getf (gallop:stats server) :suspended)))))
                   (sb-bsd-sockets:socket-shutdown (usocket:socket socket) :direction :output)
                   (sleep 0.2)          ; the end of input reaches the server
                   (is (eql 1 (getf (gallop:stats server) :suspended)))
                   (is (eq t (funcall responder '(200 (:content-type "text/plain") ("late")))))
                   (let ((response (read-wire-or-error socket :close t)))
                     (is (typep response 'wire-response) "~A" response)
                     (when (typep response 'wire-response)
                       (is (= 200 (wire-status response)))
                       (is (equal "4" (wire-header response "Content-Length")))
                       (is (equal "late" (wire-body-string response)))))
                   (is (zerop (getf (gallop:stats server) :abandoned)))))
            (usocket:socket-close socket)))
        (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open)))))))))

(test a-request-sent-while-another-is-pending-is-served-after-it
  (flet ((app (env)
           (if (string= (getf env :path-info) "/slow")
               (lambda (responder)
                 (gallop:after 0.3 (lambda ()
                                     (funcall responder '(200 (:content-type "text/plain")
                                                          ("slow"))))))
               '(200 (:content-type "text/plain") ("fast")))))
    (with-app (server #'app)
      (let ((socket (connect (native-port server))))
        (unwind-protect
             (progn
               (send socket (crlf "GET /slow HTTP/1.1" "Host: x"))
               (is (wait-until (lambda () (eql 1 (getf (gallop:stats server) :suspended)))))
               ;; Sent while the first waits for its timer: read, kept.
               (send socket (crlf "GET /fast HTTP/1.1" "Host: x"))
               (dolist (expected '("slow" "fast"))
                 (let ((response (read-wire-or-error socket :persistent t)))
                   (is (typep response 'wire-response) "~A" response)
                   (when (typep response 'wire-response)
                     (is (= 200 (wire-status response)))
                     (is (equal "4" (wire-header response "Content-Length")))
                     (is (equal expected (wire-body-string response))))))
               (is (zerop (getf (gallop:stats server) :abandoned))))
          (usocket:socket-close socket))))))

;;; A Hunchentoot handler that answers later (GALLOP:DEFER-REQUEST)

(hunchentoot:define-easy-handler (handle-deferred :uri "/deferred") (delay)
  (setf (hunchentoot:content-type*) "text/plain")
  (setf (hunchentoot:header-out :x-deferred) "yes")
  (let ((answer (gallop:defer-request)))
    (gallop:after (if delay (parse-number delay) 0.2)
                  (lambda () (funcall answer "answered later")))
    "not this"))

(defun parse-number (string)
  (let ((*read-eval* nil)) (read-from-string string)))

(defun check-deferred-answers (server)
  (let ((socket (connect (port-of server))))
    (unwind-protect
         (progn
           ;; Two on one connection: the second after the first's answer.
           (dotimes (i 2)
             (send socket (crlf "GET /deferred HTTP/1.1" "Host: x"))
             (let ((response (read-wire-or-error socket :persistent t)))
               (is (typep response 'wire-response) "~A" response)
               (when (typep response 'wire-response)
                 (is (= 200 (wire-status response)))
                 (is (equal "yes" (wire-header response "X-Deferred")))
                 (is (equal "text/plain; charset=utf-8" (wire-header response "Content-Type")))
                 (is (equal "14" (wire-header response "Content-Length")))
                 (is (equal "answered later" (wire-body-string response))))))
           ;; A HEAD: the head only.
           (send socket (crlf "HEAD /deferred HTTP/1.1" "Host: x"))
           (let ((response (read-wire-or-error socket :persistent t :head-request t)))
             (is (and (typep response 'wire-response) (= 200 (wire-status response))
                      (zerop (length (wire-body response))))
                 "~A" response)))
      (usocket:socket-close socket))
    (is (wait-until (lambda () (let ((s (gallop:stats server)))
                                 (and (zerop (getf s :suspended)) (zerop (getf s :in-flight)))))))))

(test hunchentoot-handlers-answer-later-with-defer-request
  (with-server (server 'gallop:easy-acceptor)
    (check-deferred-answers server))
  (with-server (server 'hunchentoot:easy-acceptor :taskmaster (make-instance 'gallop:taskmaster))
    (check-deferred-answers server)))

(test a-hundred-thousand-pending-timers-cost-no-thread
  (with-app (server (lambda (env) (declare (ignore env)) '(200 () ("")))
                    :standby-thread-count 4)
    (let* ((threads (sb-thread:list-all-threads))
           (fired 0)
           (timers (loop repeat 100000
                         collect (gallop:after 600 (lambda () (incf fired)) :server server))))
      (is (= 100000 (getf (gallop:stats server) :timers)))
      (is (null (threads-started-since threads)) "threads started for the timers: ~S"
          (threads-started-since threads))
      (is (every #'gallop:cancel-timer timers))
      (is (zerop (getf (gallop:stats server) :timers)))
      (is (zerop fired)))))
