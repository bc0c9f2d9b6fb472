;;;; shutdown.lisp -- stopping under load: a soft stop in the middle of a wrk
;;;; run answers every request the server took, and a stop with 10,000 idle
;;;; connections closes them all; through the native API and
;;;; GALLOP:EASY-ACCEPTOR.
;;;;
;;;; The soft stop's check is an exact count: wrk runs longer than the server
;;;; lives, so every response the server wrote reaches wrk before wrk ends,
;;;; and wrk's total of completed requests must equal the number of requests
;;;; the handler finished.  A response cut off by the stop would show as a
;;;; difference (and in the server's log).  Connections refused or reset once
;;;; the server stopped listening are wrk's socket errors, not requests: they
;;;; are not asserted on.
;;;;
;;;; Both ends of 10,000 connections need 20,000 fds, the most one process may
;;;; have here: that server runs in a child process
;;;; (tests/child/stop-server.lisp).

(in-package #:gallop-tests)

(in-suite stress)

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

(defun start-child-server (kind)
  "Start tests/child/stop-server.lisp with KIND; return the process and its port."
  (let* ((process (sb-ext:run-program
                   "scripts/lisp.sh" (list "--load" "tests/child/stop-server.lisp"
                                           "--end-toplevel-options" kind)
                   :search t :wait nil :input :stream :output :stream :error nil
                   :directory (asdf:system-source-directory "gallop")))
         (line (read-line (sb-ext:process-output process) nil "")))
    (values process (and (uiop:string-prefix-p "READY " line)
                         (parse-integer line :start 6)))))

(defun child-command (process command)
  "Send COMMAND to the child server; return its one-line answer."
  (write-line command (sb-ext:process-input process))
  (finish-output (sb-ext:process-input process))
  (read-line (sb-ext:process-output process) nil ""))

(defun child-stats (process)
  "The child server's GALLOP:STATS, read from its answer to \"stats\"."
  (let ((line (child-command process "stats")))
    (and (uiop:string-prefix-p "STATS " line)
         (let ((*read-eval* nil) (*package* (find-package :keyword)))
           (ignore-errors (read-from-string line t nil :start 6))))))

(defun end-child-server (process)
  (ignore-errors (write-line "quit" (sb-ext:process-input process))
                 (finish-output (sb-ext:process-input process)))
  (sb-ext:process-wait process)
  (sb-ext:process-close process))

(defun stop-with-idle-connections (kind count)
  "Open COUNT keep-alive connections to a KIND child server, one request
each, stop the server, and check that every connection was closed."
  (raise-fd-limit)
  (multiple-value-bind (process port) (start-child-server kind)
    (let ((sockets '()))
      (unwind-protect
           (progn
             (is (integerp port) "the ~A child server did not start" kind)
             ;; In batches of 500: send every request, then read every
             ;; answer (all at once would overflow the accept queue: 503s).
             (let ((answered 0))
               (loop while (< (length sockets) count)
                     do (let ((batch (loop repeat (min 500 (- count (length sockets)))
                                           collect (let ((s (connect port :timeout 30)))
                                                     (send s (crlf "GET / HTTP/1.1" "Host: x"))
                                                     s))))
                          (setf sockets (append batch sockets))
                          (dolist (s batch)
                            (let ((r (read-response s)))
                              (when (and r (= 200 (response-status r)))
                                (incf answered))))))
               (is (= count answered)))
             (let ((stats (child-command process "stats")))
               (is (search (format nil ":IDLE ~D " count) stats) "~A" stats))
             (let* ((answer (child-command process "stop"))
                    (ms (and (uiop:string-prefix-p "STOPPED " answer)
                             (parse-integer answer :start 8))))
               (is (integerp ms) "stop answered ~S" answer)
               ;; Timing is measured and printed, not asserted.
               (format t "~&    ~A: stop with ~D idle connections took ~A ms~%" kind count ms))
             (is (= count (count-if (lambda (s) (closed-by-peer-p s :timeout 5)) sockets))
                 "not every idle connection was closed by the stop"))
        (mapc #'usocket:socket-close sockets)
        (end-child-server process)))))

(test stop-closes-ten-thousand-idle-connections-native
  (stop-with-idle-connections "native" 10000))

(test stop-closes-ten-thousand-idle-connections-easy-acceptor
  (stop-with-idle-connections "easy-acceptor" 10000))
