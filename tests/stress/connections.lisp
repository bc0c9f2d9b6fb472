;;;; connections.lisp -- thousands of idle, slow and pending connections
;;;; hold no thread: idle keep-alive and TLS connections, slowloris (our own
;;;; and slowhttptest's), requests answered later by timers or deferred.

(in-package #:gallop-tests)

(in-suite stress)

;;; Many idle and slow connections hold no thread

(test two-thousand-idle-keep-alive-connections-hold-no-thread
  (raise-test-fd-limit)
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :standby-thread-count 4))
    (let ((sockets '()))
      (unwind-protect
           (progn
             (dotimes (i 2000)
               (let ((socket (connect (port-of server))))
                 (push socket sockets)
                 (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))))
             (is (= 2000 (count-if (lambda (s)
                                     (let ((r (read-response s)))
                                       (and r (= 200 (response-status r)))))
                                   sockets)))
             (is (wait-until (lambda () (= 2000 (stat server :idle)))))
             ;; 2,000 open connections, and the pool is still its standby size.
             (is (<= (stat server :threads) 12) "threads: ~D" (stat server :threads))
             ;; A new client is served at once, and so are the idle ones.
             (is (= 200 (response-status (get-request (port-of server) "/yo"))))
             (let ((some (subseq sockets 0 50)))
               (dolist (s some) (send s (crlf "GET /yo?name=again HTTP/1.1" "Host: x")))
               (is (every (lambda (s) (string= "Hey again!" (body-string (read-response s))))
                          some))))
        (mapc #'usocket:socket-close sockets)))
    (is (wait-until (lambda () (zerop (stat server :open)))))))

(defun slowloris (port count seconds &key (interval 1))
  "Open COUNT connections that send a request head one header line every
INTERVAL seconds for SECONDS, never finishing it.  Returns the sockets."
  (let ((sockets (loop repeat count
                       collect (let ((s (connect port)))
                                 (send s (format nil "GET /yo HTTP/1.1~C~C" #\Return #\Linefeed))
                                 s))))
    (loop repeat (floor seconds interval)
          do (sleep interval)
             (dolist (s sockets)
               (ignore-errors (send s (format nil "X-a: b~C~C" #\Return #\Linefeed)))))
    sockets))

(test slowloris-neither-blocks-requests-nor-grows-the-pool
  (raise-test-fd-limit)
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :standby-thread-count 4
                                                                     :header-timeout 30))
    (let* ((sockets nil)
           (attacker (sb-thread:make-thread
                      (lambda () (setf sockets (slowloris (port-of server) 1000 4)))))
           (statuses '())
           (worst 0)
           (peak-threads 0))
      (unwind-protect
           (progn
             (loop while (sb-thread:thread-alive-p attacker)
                   do (let* ((start (get-internal-real-time))
                             (r (get-request (port-of server) "/yo")))
                        (push (response-status r) statuses)
                        (setf worst (max worst (- (get-internal-real-time) start))
                              peak-threads (max peak-threads (stat server :threads))))
                      (sleep 0.05))
             (sb-thread:join-thread attacker)
             (is (plusp (length statuses)))
             (is (every (lambda (s) (= 200 s)) statuses))
             ;; 1,000 slow clients are parked, not served: no thread each.
             (is (<= 1000 (stat server :idle)))
             (is (<= peak-threads 12) "peak threads: ~D" peak-threads)
             (format t "~&    slowloris: ~D requests, slowest ~,1F ms, peak threads ~D~%"
                     (length statuses)
                     (/ worst (/ internal-time-units-per-second 1000)) peak-threads))
        (mapc #'usocket:socket-close sockets)))))

(test slowhttptest-slowloris-leaves-the-service-available
  (raise-test-fd-limit)
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :standby-thread-count 4))
    (let* ((output nil)
           (attacker (sb-thread:make-thread
                      (lambda ()
                        (setf output
                              (uiop:run-program
                               (list "slowhttptest" "-H" "-c" "1000" "-r" "500" "-i" "1"
                                     "-l" "6" "-p" "2" "-x" "8"
                                     "-u" (url server "/yo"))
                               :output :string :error-output :output :ignore-error-status t)))))
           (statuses '())
           (peak-threads 0))
      (loop while (sb-thread:thread-alive-p attacker)
            do (push (response-status (get-request (port-of server) "/yo")) statuses)
               (setf peak-threads (max peak-threads (stat server :threads)))
               (sleep 0.1))
      (sb-thread:join-thread attacker)
      (is (every (lambda (s) (= 200 s)) statuses))
      (is (<= peak-threads 12) "peak threads: ~D" peak-threads)
      (is (search "service available" output) "slowhttptest ran: ~A" output)
      (is (not (search "service available:   NO" output)) "~A" output))))

;;; Idle TLS connections hold no thread

(defparameter *idle-tls-connections* 2000)

(defun check-idle-tls-connections (port stats standby)
  "Open *IDLE-TLS-CONNECTIONS* TLS connections to PORT, each answered once
\(read strictly) and then left idle: all stay open, parked in epoll, while
the pool keeps its STANDBY threads; a fresh client is served meanwhile.
Then they go away and every one is closed."
  (let ((clients '())
        (good 0))
    (unwind-protect
         (progn
           (dotimes (i *idle-tls-connections*)
             (let ((client (tls-connect port)))
               (push client clients)
               (let ((response (tls-get client "/yo")))
                 (when (and (wire-response-p response) (= 200 (wire-status response))
                            (equal "Hey!" (wire-body-string response)))
                   (incf good)))))
           (is (= *idle-tls-connections* good) "~D of ~D answered" good *idle-tls-connections*)
           (is (wait-until (lambda () (= *idle-tls-connections* (getf (funcall stats) :idle))))
               "not all parked: ~S" (funcall stats))
           (let ((s (funcall stats)))
             (is (= *idle-tls-connections* (getf s :open)) "~S" s)
             (is (<= (getf s :threads) (+ standby 4)) "threads: ~S" s)
             (is (zerop (getf s :in-flight)) "~S" s))
           (let ((client (tls-connect port)))
             (unwind-protect (check-exact-tls-answer "a fresh client" (tls-get client "/yo" :close t)
                                                     "Hey!")
               (tls-close client))))
      (mapc #'tls-close clients))
    (is (wait-until (lambda () (zerop (getf (funcall stats) :open))) :timeout 20)
        "left open: ~S" (funcall stats))))

(test idle-tls-connections-hold-no-thread
  (raise-fd-limit (+ 1000 (* 3 *idle-tls-connections*)))
  (flet ((yo-app (env) (declare (ignore env)) '(200 (:content-type "text/plain") ("Hey!"))))
    (with-tls-app (server #'yo-app :standby-thread-count 2)
      (check-idle-tls-connections (native-port server) (lambda () (gallop:stats server)) 2)))
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor
                                 :taskmaster (make-instance 'gallop:taskmaster
                                                            :standby-thread-count 2))))
    (hunchentoot:start server)
    (unwind-protect
         (check-idle-tls-connections (port-of server) (lambda () (gallop:stats server)) 2)
      (hunchentoot:stop server))))

;;; Pending requests (answered later by timers, or deferred) hold no thread

(test pending-requests-answered-by-timers-hold-no-thread
  (raise-fd-limit (+ 1000 (* 3 *pending-requests*)))
  (with-app (server #'delayed-app :standby-thread-count 4)
    (let ((sockets '()))
      (unwind-protect
           (progn
             (setf sockets (open-requests (native-port server) *pending-requests* "/later"))
             (let ((most-threads (wait-for-pending-answers server)))
               (is (<= most-threads (+ 4 4)) "the pool grew to ~D threads" most-threads))
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

(test deferred-hunchentoot-requests-hold-no-thread
  (raise-fd-limit (+ 1000 (* 3 *pending-requests*)))
  (with-server (server 'gallop:easy-acceptor)
    (let ((sockets '()))
      (unwind-protect
           (progn
             (setf sockets (open-requests (port-of server) *pending-requests* "/deferred?delay=1"))
             (let ((most-threads (wait-for-pending-answers server)))
               (is (<= most-threads (+ 4 4)) "the pool grew to ~D threads" most-threads))
             (let ((good (count-if (lambda (socket)
                                     (let ((r (read-wire-or-error socket :persistent t)))
                                       (and (typep r 'wire-response) (= 200 (wire-status r))
                                            (equal "answered later" (wire-body-string r)))))
                                   sockets)))
               (is (= *pending-requests* good) "~D of ~D answered" good *pending-requests*)))
        (mapc #'usocket:socket-close sockets)))))

;;; Server-sent events to many clients

(test server-sent-events-reach-a-thousand-clients-in-order
  (check-sse-clients 1000))
