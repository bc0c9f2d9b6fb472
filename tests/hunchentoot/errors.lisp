;;;; errors.lisp -- a handler's error on Gallop's acceptors: answered with
;;;; the bytes stock Hunchentoot writes, at a bounded cost in the log (a
;;;; message of at most GALLOP.CORE:+MAX-LOG-LINE+ characters, a backtrace of
;;;; at most GALLOP::+BACKTRACE-FRAMES+ frames), and a client that timed out
;;;; logged once, not once a client.

(in-package #:gallop-tests)
(in-suite requests)

(defun deep-failure (depth items)
  "Fail DEPTH calls down, with ITEMS (a long list) an argument of each."
  (if (zerop depth)
      (error "deep failure")
      (1+ (deep-failure (1- depth) items))))

(hunchentoot:define-easy-handler (ht-error-plain :uri "/err/plain") ()
  (error "plain failure ~D" 42))

(hunchentoot:define-easy-handler (ht-error-huge :uri "/err/huge") ()
  (error "huge failure ~A" (make-string 100000 :initial-element #\x)))

(hunchentoot:define-easy-handler (ht-error-deep :uri "/err/deep") ()
  (deep-failure 300 (make-list 10000 :initial-element 'item)))

(hunchentoot:define-easy-handler (ht-error-bad-request :uri "/err/bad-request") ()
  (error 'hunchentoot:bad-request))

(hunchentoot:define-easy-handler (ht-error-after-head :uri "/err/after-head") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((stream (hunchentoot:send-headers)))
    (write-sequence (octets "partial") stream)
    (force-output stream)
    (error "failure after the head")))

(defparameter *error-paths* '("/err/plain" "/err/bad-request" "/err/after-head")
  "The paths whose answers stock Hunchentoot and Gallop must write alike.  Not
/err/deep: stock Hunchentoot prints its 300 frames with every argument in
full, tens of megabytes, and may not answer at all.")

(defun error-exchange (port path)
  "The octets PORT sends for GET PATH with Connection: close, to the end of
the connection, as a string with the Date value and the port blanked."
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket (crlf (format nil "GET ~A HTTP/1.1" path) "Host: h" "Connection: close"))
           (without-port
            (cl-ppcre:regex-replace "(?m)^Date: [^\\r]*\\r$"
                                    (latin1 (read-to-eof (usocket:socket-stream socket)))
                                    "Date: -")))
      (usocket:socket-close socket))))

(test handler-errors-are-answered-with-the-bytes-stock-writes
  ;; A handler's error (500), BAD-REQUEST (400), and an error after the head
  ;; was sent (the answer cut, the connection closed): the same bytes from
  ;; stock Hunchentoot and from Gallop's easy-acceptor.
  (let ((stock (with-server (server 'hunchentoot:easy-acceptor)
                 (mapcar (lambda (path) (error-exchange (port-of server) path)) *error-paths*)))
        (gallop (with-server (server 'gallop:easy-acceptor)
                  (mapcar (lambda (path) (error-exchange (port-of server) path)) *error-paths*))))
    (loop for path in *error-paths*
          for s in stock
          for g in gallop
          do (is (string= s g) "For ~A:~%stock:  ~S~%gallop: ~S" path s g))
    (destructuring-bind (plain bad-request after-head) gallop
      (is (search "HTTP/1.1 500 Internal Server Error" plain :end2 40))
      (is (search "HTTP/1.1 400 Bad Request" bad-request :end2 40))
      (is (search "partial" after-head)))))

(defun log-entries (text)
  "The entries of a Hunchentoot message log: each starts with \"[\" at the
start of a line; lines that do not belong to the entry before."
  (let ((starts (cons 0 (loop with start = 0
                              for position = (search (format nil "~%[") text :start2 start)
                              while position
                              collect (1+ position)
                              do (setf start (1+ position))))))
    (loop for (start end) on starts
          collect (subseq text start (or end (length text))))))

(defun frame-lines (entry)
  "How many lines of ENTRY are backtrace frames (\"N: (...\")."
  (length (cl-ppcre:all-matches-as-strings "(?m)^\\d+: " entry)))

(defun brief (text)
  "TEXT, or its first 2000 characters: what a failure shows of it."
  (if (> (length text) 2000) (subseq text 0 2000) text))

(defun entry-with (entries text)
  (find-if (lambda (entry) (search text entry)) entries))

(test handler-error-log-entries-are-bounded
  ;; Each logged error is at most +MAX-LOG-LINE+ characters (with the date
  ;; in front), with at most +BACKTRACE-FRAMES+ frames, its arguments
  ;; printed short; on GALLOP:EASY-ACCEPTOR, and the message cut on a
  ;; stock acceptor with GALLOP:TASKMASTER.
  (let ((limit (+ gallop.core:+max-log-line+ 64)))
    (let ((log (make-string-output-stream)))
      (with-server (server 'gallop:easy-acceptor :message-log-destination log)
        (dolist (path '("/err/plain" "/err/huge" "/err/deep"))
          (is (search "HTTP/1.1 500 Internal Server Error"
                      (error-exchange (port-of server) path) :end2 40)
              "~A was not answered 500" path)))
      (let* ((entries (log-entries (get-output-stream-string log)))
             (plain (entry-with entries "plain failure 42"))
             (huge (entry-with entries "huge failure xxx"))
             (deep (entry-with entries "deep failure")))
        (is (= 3 (length entries)) "~D entries:~%~{~A~%~}" (length entries)
            (mapcar #'brief entries))
        (dolist (entry entries)
          (is (<= (length entry) limit) "an entry of ~D characters" (length entry)))
        (is-true (and plain (< 0 (frame-lines plain) (1+ gallop::+backtrace-frames+))))
        (is-true (and huge (search "not logged)" huge)))
        (is (and deep (= gallop::+backtrace-frames+ (frame-lines deep)))
            "frames: ~D" (and deep (frame-lines deep)))
        ;; The list of 10,000 ITEMs is printed as its first eight.
        (is (and deep (search "DEEP-FAILURE" deep) (search "ITEM ...)" deep)
                 (every (lambda (line) (<= (count-matches "ITEM" line) 8))
                        (uiop:split-string deep :separator '(#\Newline))))
            "the arguments were not printed short: ~A" (brief deep))))
    (let ((log (make-string-output-stream)))
      (with-server (server 'hunchentoot:easy-acceptor :message-log-destination log
                                                      :taskmaster (make-instance 'gallop:taskmaster))
        (error-exchange (port-of server) "/err/huge"))
      (let ((entries (log-entries (get-output-stream-string log))))
        (is (= 1 (length entries)))
        (is (<= (length (first entries)) limit) "an entry of ~D characters" (length (first entries)))
        (is-true (search "not logged)" (first entries)))))))

(test a-storm-of-errors-takes-a-few-backtraces-a-second
  ;; Every error is logged with its message; only the first
  ;; +BACKTRACES-PER-SECOND+ of each second with a backtrace.
  (let ((log (make-string-output-stream))
        (first-second 0) (last-second 0))
    (with-server (server 'gallop:easy-acceptor :message-log-destination log)
      (setf first-second (floor (core-now-ms) 1000))
      (dotimes (i 30)
        (error-exchange (port-of server) "/err/plain"))
      (setf last-second (floor (core-now-ms) 1000)))
    (let* ((entries (log-entries (get-output-stream-string log)))
           (traced (count-if (lambda (entry) (plusp (frame-lines entry))) entries))
           (noted (count-if (lambda (entry) (search "No backtrace: more than" entry)) entries)))
      (is (= 30 (length entries)))
      (is (every (lambda (entry) (search "plain failure 42" entry)) entries))
      (is (= 30 (+ traced noted)))
      (is (<= gallop.core:+backtraces-per-second+ traced
              (* gallop.core:+backtraces-per-second+ (1+ (- last-second first-second))))
          "~D backtraces in ~D s" traced (1+ (- last-second first-second))))))

(hunchentoot:define-easy-handler (ht-error-flood :uri "/err/flood") ()
  ;; Up to 8 MiB, 16 KiB every 10 ms, to a client that reads none of it: a
  ;; write times out once the client made no progress for the write timeout
  ;; (before, the writer does not wait: the account takes what it writes).
  (setf (hunchentoot:content-type*) "application/octet-stream")
  (let ((stream (hunchentoot:send-headers))
        (block (make-array 16384 :element-type '(unsigned-byte 8) :initial-element 97)))
    (dotimes (i 512)
      (sleep 0.01)
      (write-sequence block stream))
    nil))

(defun flood-non-readers (port count)
  "COUNT clients ask PORT for /err/flood and read nothing; returns their sockets."
  (loop repeat count
        collect (let ((socket (connect port)))
                  (send socket (crlf "GET /err/flood HTTP/1.1" "Host: h"))
                  socket)))

(test a-client-timeout-is-logged-once-not-once-a-client
  ;; Three clients that read none of a streamed answer: three write
  ;; timeouts, one log entry (without a backtrace), on both front ends.
  (let ((log (make-string-output-stream))
        (sockets '()))
    (with-server (server 'gallop:easy-acceptor :message-log-destination log :write-timeout 1)
      (unwind-protect
           (progn
             (setf sockets (flood-non-readers (port-of server) 3))
             (is (wait-until (lambda () (and (= 3 (stat server :requests))
                                             (zerop (stat server :in-flight))))
                             :timeout 20)
                 "the handlers did not end: ~S" (gallop:stats server)))
        (mapc #'usocket:socket-close sockets)))
    (let* ((entries (log-entries (get-output-stream-string log)))
           (timeouts (remove-if-not (lambda (entry) (search "timed out" entry)) entries)))
      (is (= 1 (length timeouts)) "~D entries:~%~{~A~%~}" (length entries)
          (mapcar #'brief entries))
      (is (zerop (count-if (lambda (entry) (search "Backtrace" entry)) entries)))))
  (let ((log (make-string-output-stream))
        (sockets '()))
    (with-app (server (lambda (env)
                        (declare (ignore env))
                        (lambda (respond)
                          (let ((write (funcall respond '(200 (:content-type "application/octet-stream"))))
                                (block (make-array 16384 :element-type '(unsigned-byte 8)
                                                         :initial-element 97)))
                            (loop repeat 512 while (progn (sleep 0.01) (funcall write block)))
                            (funcall write nil :close t))))
                      :write-timeout 1 :log log)
      (unwind-protect
           (progn
             (setf sockets (flood-non-readers (native-port server) 3))
             (is (wait-until (lambda () (and (= 3 (getf (gallop:stats server) :requests))
                                             (zerop (getf (gallop:stats server) :in-flight))))
                             :timeout 20)
                 "the app did not end: ~S" (gallop:stats server)))
        (mapc #'usocket:socket-close sockets)))
    (let* ((text (get-output-stream-string log))
           (lines (remove "" (uiop:split-string text :separator '(#\Newline)) :test #'string=)))
      (is (= 1 (count-if (lambda (line) (search "timed out" line)) lines)) "log:~%~A" (brief text)))))

(defclass recording-acceptor (gallop:easy-acceptor)
  ((logged :initform '() :accessor logged))
  (:documentation "Keeps the arguments of each message its log is given."))

(defmethod hunchentoot:acceptor-log-message ((acceptor recording-acceptor) log-level
                                             format-string &rest format-arguments)
  (declare (ignore log-level format-string))
  (push format-arguments (logged acceptor)))

(test a-users-log-method-sees-the-error
  ;; A message within the bound reaches methods of the user's own as it
  ;; came: with the condition among its arguments.
  (with-server (server 'recording-acceptor :message-log-destination (make-broadcast-stream))
    (error-exchange (port-of server) "/err/plain")
    (is (= 1 (length (logged server))))
    (is (some (lambda (arg) (typep arg 'simple-error)) (first (logged server)))
        "the arguments: ~S" (first (logged server)))))
