;;;; aborts.lisp -- clients that give up halfway: they close or reset (RST)
;;;; the connection in the middle of a request head, of a body, or of a
;;;; response, or half-close it after their request.  Each costs at most one
;;;; log line, its fd is closed, its worker comes back, and the server serves
;;;; on.  Run against each layer: the native API, GALLOP:EASY-ACCEPTOR, and
;;;; GALLOP:TASKMASTER on a stock acceptor.

(in-package #:gallop-tests)

(in-suite core)

(defun reset-on-close (socket)
  "Make closing SOCKET send a TCP RST instead of a FIN (SO_LINGER, 0 s)."
  (set-reset-on-close (sb-bsd-sockets:socket-file-descriptor (usocket:socket socket))))

(defun abort-connection (socket how)
  "Give up on SOCKET: HOW is :CLOSE (FIN) or :RESET (RST)."
  (when (eq how :reset) (reset-on-close socket))
  (ignore-errors (usocket:socket-close socket)))

(defun send-then-abort (port string how)
  (let ((socket (connect port)))
    (handler-case (send socket string) (error () nil))
    (sleep 0.05)                        ; let the server start on it
    (abort-connection socket how)))

(defun read-some-then-abort (port string bytes how)
  "Send STRING (a request for a large response), read BYTES of the answer,
then give up."
  (let ((socket (connect port)))
    (send socket string)
    (let ((buffer (make-array bytes :element-type '(unsigned-byte 8))))
      (read-sequence buffer (usocket:socket-stream socket)))
    (abort-connection socket how)))

(defun half-close-gets-its-answer (port)
  "Send a whole request, shut the write side, and read: true when the answer
is a 200 followed by the server's close."
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))
           (sb-bsd-sockets:socket-shutdown (usocket:socket socket) :direction :output)
           (let ((response (read-response socket)))
             (and response (= 200 (response-status response))
                  (closed-by-peer-p socket))))
      (usocket:socket-close socket))))

(defparameter *aborting-clients*
  (list
   (cons "half a head, then FIN"
         (lambda (port how) (declare (ignore how))
           (send-then-abort port (format nil "GET /yo HTTP/1.1~C~CHo" #\Return #\Linefeed) :close)))
   (cons "half a head, then RST"
         (lambda (port how) (declare (ignore how))
           (send-then-abort port (format nil "GET /yo HTTP/1.1~C~CHo" #\Return #\Linefeed) :reset)))
   (cons "part of a Content-Length body"
         (lambda (port how)
           (send-then-abort port (concatenate 'string
                                              (crlf "POST /body HTTP/1.1" "Host: x"
                                                    "Content-Length: 100000")
                                              (make-string 1000 :initial-element #\a))
                            how)))
   (cons "part of a chunked body"
         (lambda (port how)
           (send-then-abort port (concatenate 'string
                                              (crlf "POST /body HTTP/1.1" "Host: x"
                                                    "Transfer-Encoding: chunked")
                                              (format nil "400~C~Cabc" #\Return #\Linefeed))
                            how)))
   (cons "part of a 1 MiB response"
         (lambda (port how)
           (read-some-then-abort port (crlf "GET /big HTTP/1.1" "Host: x") 4000 how))))
  "Ways to give up halfway: (DESCRIPTION . (LAMBDA (PORT HOW))), HOW :CLOSE or :RESET.")

(defun big-body-app (env)
  "The native counterpart of the easy-handlers /yo, /body and /big."
  (let ((path (getf env :path-info)))
    (cond ((string= path "/big")
           (list 200 '(:content-type "application/octet-stream")
                 (make-array (* 1024 1024) :element-type '(unsigned-byte 8) :initial-element 7)))
          ((string= path "/body")
           ;; As the easy-handler /body: "length:body".
           (let ((body (read-all-octets (getf env :raw-body))))
             (list 200 '(:content-type "text/plain")
                   (list (format nil "~D:~A" (length body) (map 'string #'code-char body))))))
          (t '(200 (:content-type "text/plain") ("Hey!"))))))

(defun check-aborts (port stats log-text &key (max-log-entries-per-abort 1))
  "Run every aborting client against PORT, twice each way; check the server
serves on, frees every connection, and logged at most
MAX-LOG-ENTRIES-PER-ABORT entries per abort.  STATS returns the server's
stats; LOG-TEXT its log so far."
  (let ((fds (fd-count))
        (aborts 0))
    (loop for (description . client) in *aborting-clients*
          do (dolist (how '(:close :reset :close :reset))
               (funcall client port how)
               (incf aborts)))
    (is (half-close-gets-its-answer port) "a half-closed client gets its answer")
    (is (= 200 (response-status (get-request port "/yo"))))
    (is (wait-until (lambda () (let ((s (funcall stats)))
                                 (and (zerop (getf s :open)) (zerop (getf s :in-flight)))))
                    :timeout 10)
        "every aborted connection closed: ~S" (funcall stats))
    (is (wait-until (lambda () (<= (fd-count) fds)) :timeout 5)
        "fds: ~D before, ~D after" fds (fd-count))
    ;; A log entry starts with "[" at the start of a line (Hunchentoot's
    ;; "[date [ERROR]]", Gallop's "[gallop date]"); a backtrace may follow it.
    (let* ((text (funcall log-text))
           (entries (+ (if (and (plusp (length text)) (char= (char text 0) #\[)) 1 0)
                       (count-matches (format nil "~%[") text))))
      (is (<= entries (* max-log-entries-per-abort aborts)) "~D log entries for ~D aborts:~%~A" entries aborts
          (subseq text 0 (min 3000 (length text)))))))

(test native-aborting-clients-cost-no-log-line-and-leak-nothing
  ;; The native API doesn't log a client's going away at all; it counts it.
  (let ((log (make-string-output-stream))
        (text ""))
    (with-app (server #'big-body-app :log log)
      (check-aborts (native-port server)
                    (lambda () (gallop:stats server))
                    (lambda () (setf text (concatenate 'string text (get-output-stream-string log))))
                    :max-log-entries-per-abort 0)
      (is (plusp (getf (gallop:stats server) :aborted))))))

(test easy-acceptor-aborting-clients-cost-no-log-line-and-leak-nothing
  ;; Hunchentoot would log each as an error with a backtrace; Gallop's
  ;; acceptors count them instead.
  (let ((log (make-string-output-stream))
        (text ""))
    (with-server (server 'gallop:easy-acceptor :message-log-destination log)
      (check-aborts (port-of server)
                    (lambda () (gallop:stats server))
                    (lambda () (setf text (concatenate 'string text (get-output-stream-string log))))
                    :max-log-entries-per-abort 0)
      (is (plusp (stat server :aborted))))))

(test taskmaster-aborting-clients-cost-at-most-a-log-line-and-leak-nothing
  (let ((log (make-string-output-stream))
        (text ""))
    (with-server (server 'hunchentoot:easy-acceptor :message-log-destination log
                                                    :taskmaster (make-instance 'gallop:taskmaster))
      (check-aborts (port-of server)
                    (lambda () (gallop:stats server))
                    (lambda () (setf text (concatenate 'string text (get-output-stream-string log))))))))
