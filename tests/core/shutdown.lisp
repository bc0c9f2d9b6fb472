;;;; shutdown.lisp -- a soft stop in the middle of a wrk run answers every
;;;; request the server took; through the native API and GALLOP:EASY-ACCEPTOR.
;;;;
;;;; The check is an exact count: wrk runs longer than the server lives, so
;;;; every response the server wrote reaches wrk before wrk ends, and wrk's
;;;; total of completed requests must equal the number of requests the
;;;; handler finished.  A response cut off by the stop would show as a
;;;; difference (and in the server's log).  Connections refused or reset
;;;; once the server stopped listening are wrk's socket errors, not
;;;; requests: they are not asserted on.

(in-package #:gallop-tests)

(in-suite core)

(defvar *nap-counter* (list 0)
  "A cons whose car counts finished /nap requests (ATOMIC-INCF needs a place
it can update atomically from every worker).")

(defun nap ()
  "What /nap does: 10 ms of blocking work, then count itself finished."
  (sleep 0.01)
  (sb-ext:atomic-incf (car *nap-counter*))
  "ok")

(hunchentoot:define-easy-handler (handle-nap :uri "/nap") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (nap))

(defun nap-app (env)
  (declare (ignore env))
  (list 200 '(:content-type "text/plain") (list (nap))))

(defun wrk-completed-requests (output)
  "The total of completed requests in wrk's OUTPUT (\"N requests in ...\")."
  (let ((at (search " requests in " output)))
    (and at (parse-integer output :start (1+ (or (position #\Space output :end at :from-end t) -1))
                                  :end at :junk-allowed t))))

(defun soft-stop-under-wrk (port stop)
  "Run wrk for 3 s against /nap on PORT with 50 keep-alive connections, call
STOP after 1 s, and check that wrk completed exactly the requests /nap
finished."
  (setf (car *nap-counter*) 0)
  (let* ((output nil)
         (wrk (sb-thread:make-thread
               (lambda ()
                 (setf output (uiop:run-program
                               (list "wrk" "-t1" "-c50" "-d3s" "--timeout" "10s"
                                     (format nil "http://127.0.0.1:~D/nap" port))
                               :output :string :error-output :output :ignore-error-status t)))
               :name "wrk")))
    (sleep 1)
    (let ((in-flight-before (funcall stop)))
      (sb-thread:join-thread wrk)
      (let ((completed (wrk-completed-requests output))
            (finished (car *nap-counter*)))
        (is (and completed (> completed 0)) "wrk ran: ~A" output)
        (is (plusp in-flight-before) "the stop found no request in flight")
        (is (eql completed finished)
            "wrk completed ~A requests, the server finished ~D:~%~A" completed finished output)
        (is (not (search "Non-2xx" output)) "~A" output)))))

(test soft-stop-under-wrk-answers-every-request-native
  (let* ((log (make-string-output-stream))
         (server (gallop:start #'nap-app :address "127.0.0.1" :port 0 :log log)))
    (unwind-protect
         (soft-stop-under-wrk (gallop:server-port server)
                              (lambda ()
                                (prog1 (getf (gallop:stats server) :in-flight)
                                  (gallop:stop server :soft t))))
      (gallop:stop server))
    (is (string= "" (get-output-stream-string log)))))

(test soft-stop-under-wrk-answers-every-request-easy-acceptor
  (let* ((log (make-string-output-stream))
         (server (make-server 'gallop:easy-acceptor :message-log-destination log)))
    (hunchentoot:start server)
    (unwind-protect
         (soft-stop-under-wrk (port-of server)
                              (lambda ()
                                (prog1 (stat server :in-flight)
                                  (hunchentoot:stop server :soft t))))
      (when (hunchentoot:started-p server) (hunchentoot:stop server)))
    (is (string= "" (get-output-stream-string log)))))
